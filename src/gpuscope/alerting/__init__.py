"""gpuscope's alert rules, generated from one configuration (``gpuscope.alerting.config``).

- ``config``: selectors, thresholds, windows and links; the production and test profiles;
- ``names``: recording-rule names for dashboards to import;
- one module per area (``latency``, ``slo``, ``memory``, ``scheduling``, ``composite``, ``health``,
  ``bottleneck``, ``loki``) building rule groups; ``alertmanager`` building alertmanager.yml;
- ``generate``: ``gpuscope generate`` writes ``alerts/`` and ``docs/alerts.md``.
"""

from gpuscope.alerting import names
from gpuscope.alerting.config import PRODUCTION, PROFILES, TEST, Profile

__all__ = ["PRODUCTION", "PROFILES", "TEST", "Profile", "names"]
