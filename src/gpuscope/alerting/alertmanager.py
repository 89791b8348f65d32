"""alertmanager.yml: routes by severity and service, grouping by instance/GPU, inhibition.

- Severity picks the receiver (``gpuscope-page`` for critical, ``gpuscope-ticket`` for warning;
  anything unmatched goes to ``gpuscope-receiver``); all three post to the project's alert receiver,
  which tells them apart by the ``receiver`` field of the webhook payload. The URL is written once
  (a YAML anchor), so a deployment rewrites one value.
- Grouping: per alert name, and per GPU for exporter alerts or per instance for server alerts.
  Prometheus re-sends a resolved alert for 15 minutes, which keeps its group alive, and an alert
  that joins a live group waits for the group's next ``group_interval`` (5 m in production) instead
  of ``group_wait``: in a drill under load a starvation alert reached the receiver long after it
  fired because a leak had resolved on the same instance minutes before (docs/loadtest.md, "Alerts
  proven under load"). A different problem must not inherit that delay; the same alert coming back
  within 15 minutes still does (flapping).
- ``group_wait`` is at least two rule evaluation intervals, so a composite evaluated in another rule
  group still arrives before its components' group is first sent, and inhibits them.
- Inhibition: the composite silences its component alerts on the same instance; a critical alert
  silences warnings on the same instance and GPU. Source and target matchers are disjoint, so no
  alert can inhibit itself.
"""

from __future__ import annotations

import yaml

from gpuscope.alerting import composite
from gpuscope.alerting.rules import GENERATED_HEADER
from gpuscope.contract import parts
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import duration

RECEIVERS = {"critical": "gpuscope-page", "warning": "gpuscope-ticket"}
DEFAULT_RECEIVER = parts.RECEIVER.service
COMPONENT_ALERTS = tuple(name for names in composite.COMPONENTS.values() for name in names)


def config(p: Profile, receiver_url: str | None = None) -> dict:
    """The configuration as data; ``receiver_url`` overrides the profile's (tests use a local sink)."""
    n, s = p.notify, p.selectors
    webhook = [{"url": receiver_url or n.receiver_url, "send_resolved": True}]  # one object: one anchor
    grouping = {s.exporter_service: ["instance", "gpu"], s.server_service: ["instance"]}
    routes = [
        {"receiver": receiver, "matchers": [f'severity="{severity}"'],
         "routes": [{"matchers": [f'service="{service}"'], "group_by": ["alertname", *group_by]}
                    for service, group_by in grouping.items()]}
        for severity, receiver in RECEIVERS.items()
    ]
    return {
        "route": {
            "receiver": DEFAULT_RECEIVER,
            "group_by": ["alertname", "instance", "gpu"],
            "group_wait": duration(n.group_wait),
            "group_interval": duration(n.group_interval),
            "repeat_interval": duration(n.repeat_interval),
            "routes": routes,
        },
        "inhibit_rules": [
            {"source_matchers": [f'alertname="{composite.COMPOSITE}"'],
             "target_matchers": [f'alertname=~"{"|".join(COMPONENT_ALERTS)}"'],
             "equal": ["instance"]},
            {"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
             "equal": ["instance", "gpu"]},
        ],
        "receivers": [{"name": name, "webhook_configs": webhook}
                      for name in (DEFAULT_RECEIVER, *RECEIVERS.values())],
    }


class _Dumper(yaml.SafeDumper):
    """Names the shared webhook anchor; plain scalars otherwise."""

    def generate_anchor(self, node: yaml.Node) -> str:
        return "alert_receiver"


def render(p: Profile, receiver_url: str | None = None) -> str:
    body = yaml.dump(config(p, receiver_url), Dumper=_Dumper, sort_keys=False, width=10_000)
    return GENERATED_HEADER.format(profile=p.name) + body
