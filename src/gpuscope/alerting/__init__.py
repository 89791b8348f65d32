"""gpuscope's alert rules, generated from one configuration (``gpuscope.contract.profiles``).

- one module per area (``latency``, ``slo``, ``memory``, ``scheduling``, ``composite``, ``health_rules``,
  ``bottleneck``, ``energy``, ``log_rules``) building rule groups; ``sources`` the normalisation layer
  of each source; ``alertmanager`` building alertmanager.yml;
- ``generate``: the files ``gpuscope generate`` writes under ``alerts/`` and ``docs/alerts.md``.

The names other parts read (recording-rule names, thresholds, windows, selectors) are in
``gpuscope.contract``, so dashboards and the server never import this package.
"""
