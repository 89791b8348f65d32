"""Targets that leave discovery, on Kubernetes and off it, as promtool unit tests for both alert profiles.

``python -m tests.alerts.target_cases`` rewrites ``tests/alerts/cases/targets.test.yml`` (production) and
``tests/alerts/cases/test-profile/targets.test.yml`` (the same series and checks, time compressed 15×);
``tests/alerts/test_target_cases.py`` fails when either is stale.

Series are written as the upstream parts emit them:

- ``up`` of a ServiceMonitor target (prometheus-operator's generated scrape config, kube-prometheus-stack
  with the bundle's relabelling of ``job``): ``instance`` is the pod's address, with ``namespace``,
  ``pod``, ``service``, ``endpoint`` and ``container`` of the scraped pod;
- kube-state-metrics v2 (``internal/store/deployment.go``, ``internal/store/daemonset.go``):
  ``kube_deployment_spec_replicas{namespace, deployment}`` and
  ``kube_daemonset_status_desired_number_scheduled{namespace, daemonset}``, plus the labels of its own
  scrape.

Cases (production minutes):

- ``hpa_scale_down``: the HPA takes the server Deployment from 3 replicas to 1 at 20m (the pods leave
  at 21m and 22m) and a GPU node is removed at 30m (the exporter DaemonSet wants 1 instead of 2):
  silent throughout, with two kube-state-metrics replicas reporting the Deployment;
- ``lost_with_ksm``: the Deployment still wants 3, one pod's target leaves at 20m: fires;
- ``scale_down_without_ksm``: no kube-state-metrics, a target that answered until it left: silent
  (one that failed first fires: ``health.test.yml``);
- ``healthy_start``: a fresh Prometheus; the server answers from 30 s, the exporter from 90 s (a fleet's
  start): no TargetMissing alert even pending;
- ``never_scraped``: the server job has no target from the start: silent until the rules have run for
  the start grace, then firing after its ``for``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.alerts import case_files
from tests.alerts.memory_shapes import PROFILES, Profile

SERVER_POD = ('up{{job="gpuscope-server",instance="{ip}:8000",namespace="gpuscope",'
              'pod="gpuscope-server-{pod}",service="gpuscope-server",endpoint="http",container="server"}}')
EXPORTER_POD = ('up{{job="gpuscope-exporter",instance="{ip}:9400",namespace="gpuscope",'
                'pod="gpuscope-exporter-{pod}",service="gpuscope-exporter",endpoint="metrics",container="exporter"}}')
KSM = 'job="kube-state-metrics",instance="10.0.9.9:8080",namespace="gpuscope"'
DEPLOYMENT = f'kube_deployment_spec_replicas{{{KSM},deployment="gpuscope-server"}}'
DAEMONSET = f'kube_daemonset_status_desired_number_scheduled{{{KSM},daemonset="gpuscope-exporter"}}'
#: A second kube-state-metrics replica (run for availability): the same objects, its own instance.
DEPLOYMENT_HA = DEPLOYMENT.replace("10.0.9.9:8080", "10.0.9.10:8080")
RUNBOOK = "https://github.com/gpuscope/gpuscope/blob/main/docs/runbooks.md"
MISSING = 'ALERTS{alertname=~"GPU(Server|Exporter)TargetMissing"}'


@dataclass(frozen=True)
class Firing:
    alertname: str
    labels: dict[str, str]
    #: summary and description, with {ago} and {down_for} of the profile
    summary: str
    description: str


@dataclass(frozen=True)
class Check:
    minute: float
    alertname: str = ""
    firing: tuple[Firing, ...] = ()
    #: Instead of an alert: ALERTS of both TargetMissing alerts (pending included), these states.
    pending_or_firing: tuple[dict[str, str], ...] | None = None


@dataclass
class Case:
    name: str
    comment: str
    step_s: int
    series: dict[str, str]
    checks: list[Check] = field(default_factory=list)


def _some(job: str, what: str, now: int, before: int, gone: str) -> Firing:
    severity = "warning"
    return Firing(f"GPU{'Server' if job == 'gpuscope-server' else 'Exporter'}TargetMissing",
                  {"severity": severity, "service": job, "job": job, "missing": "some"},
                  f"Fewer {what} targets than {{ago}} ago ({job})",
                  f"Job {job} has {now} target(s); it had {before} {{ago}} ago. Gone from discovery: {gone}.")


def _all_server() -> Firing:
    return Firing("GPUServerTargetMissing",
                  {"severity": "critical", "service": "gpuscope-server", "job": "gpuscope-server",
                   "missing": "all"},
                  "No inference server target is scraped (gpuscope-server)",
                  "Prometheus has had no target of job gpuscope-server for {down_for}: the inference server "
                  "left service discovery or the scrape configuration, so none of its alerts can fire "
                  "(up == 0 needs a listed target).")


def _silent(*minutes: float) -> list[Check]:
    names = ("GPUServerTargetMissing", "GPUExporterTargetMissing")
    return [Check(m, name) for m in minutes for name in names]


def cases() -> list[Case]:
    pods = {"a": "10.0.1.5", "b": "10.0.1.6", "c": "10.0.1.7"}
    server = {p: SERVER_POD.format(ip=ip, pod=f"7d9f8-{p}{p}{p}{p}{p}") for p, ip in pods.items()}
    exporter = {n: EXPORTER_POD.format(ip=f"10.0.2.{i}", pod=f"x{n}") for i, n in enumerate(("n1", "n2"))}
    return [
        Case("hpa_scale_down",
             "The HPA scales the server Deployment 3 -> 1 at 20m (pods gone at 21m, 22m); a GPU node is\n"
             "removed at 30m (exporter DaemonSet 2 -> 1, its pod gone at 31m). Deliberate: silent.\n"
             "Two kube-state-metrics replicas report the Deployment: counted once.",
             60, {server["a"]: "1+0x50", server["b"]: "1+0x20 stale", server["c"]: "1+0x21 stale",
                  exporter["n1"]: "1+0x50", exporter["n2"]: "1+0x30 stale",
                  DEPLOYMENT: "3+0x19 1+0x31", DEPLOYMENT_HA: "3+0x19 1+0x31", DAEMONSET: "2+0x29 1+0x21"},
             _silent(21, 23, 25, 30, 33, 36, 40, 45)),
        Case("lost_with_ksm",
             "The Deployment still wants 3; one pod's target leaves at 20m (its node is gone, the pod\n"
             "cannot be placed). Fires after its for (2m; the test profile's floor, 20s, is 5m here).",
             60, {server["a"]: "1+0x30", server["b"]: "1+0x30", server["c"]: "1+0x19 stale",
                  DEPLOYMENT: "3+0x30"},
             [Check(21, "GPUServerTargetMissing"),
              Check(26, "GPUServerTargetMissing",
                    (_some("gpuscope-server", "inference server", 2, 3, "10.0.1.7:8000"),))]),
        Case("scale_down_without_ksm",
             "No kube-state-metrics; one of three targets leaves at 20m after answering every scrape\n"
             "(a scale-down). Silent.",
             60, {'up{job="gpuscope-server",instance="server:8000"}': "1+0x40",
                  'up{job="gpuscope-server",instance="server:8001"}': "1+0x40",
                  'up{job="gpuscope-server",instance="server:8002"}': "1+0x19 stale"},
             [Check(m, "GPUServerTargetMissing") for m in (21, 23, 26, 30)]),
        Case("healthy_start",
             "A fresh Prometheus: the server answers from 30s, the exporter from 90s (a fleet's start).\n"
             "Neither TargetMissing alert is even pending.",
             15, {server["a"]: "_ _ 1+0x60", exporter["n1"]: "_x6 1+0x60"},
             [Check(m, pending_or_firing=()) for m in (0.5, 1, 1.5, 2, 3, 5, 8, 15)]),
        Case("never_scraped",
             "The server job never has a target (the exporter does): nothing before the rules have run\n"
             "for the start grace (5m; 2m in the test profile, where a start is no faster), firing\n"
             "after its for.",
             60, {exporter["n1"]: "_ 1+0x45"},
             [Check(4, pending_or_firing=()),
              Check(40, pending_or_firing=({"alertname": "GPUServerTargetMissing", "alertstate": "firing",
                                            "job": "gpuscope-server", "missing": "all",
                                            "service": "gpuscope-server", "severity": "critical"},)),
              Check(40, "GPUServerTargetMissing", (_all_server(),))]),
    ]


# --- rendering -----------------------------------------------------------------------------------------

def _seconds(minutes: float, p: Profile) -> str:
    return f"{minutes * 60 / p.compression:g}s"


def _windows(p: Profile) -> dict[str, str]:
    from gpuscope.alerting.rules import duration
    from gpuscope.contract.profiles import PROFILES as ALERT_PROFILES

    w = ALERT_PROFILES[p.name].windows
    return {"ago": duration(w.target_missing), "down_for": duration(w.scrape_down_for)}


def _group_order(p: Profile) -> list[str]:
    from gpuscope.alerting.generate import group_order
    from gpuscope.contract.profiles import PROFILES as ALERT_PROFILES

    return ["group_eval_order:", *(f"  - {name}" for name in group_order(ALERT_PROFILES[p.name]))]


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def render(p: Profile) -> str:
    out = [f"# Generated by `python -m tests.alerts.target_cases` ({p.name} profile); do not edit. The",
           "# cases, the upstream formats of their series and why each is there:",
           "# tests/alerts/target_cases.py.",
           "rule_files:", f"  - {p.rules}/sources.rules.yml", f"  - {p.rules}/gpuscope.rules.yml",
           *_group_order(p), f"evaluation_interval: {p.evaluation_interval_s}s", "tests:"]
    windows = _windows(p)
    for case in cases():
        out += [f"  # {line}" for line in case.comment.splitlines()]
        out += [f"  - name: {case.name}", f"    interval: {case.step_s / p.compression:g}s",
                "    input_series:"]
        for series, values in case.series.items():
            out += [f"      - series: '{series}'", f"        values: '{values}'"]
        alerts = [c for c in case.checks if c.pending_or_firing is None]
        exprs = [c for c in case.checks if c.pending_or_firing is not None]
        if alerts:
            out.append("    alert_rule_test:")
        for check in alerts:
            out += [f"      - eval_time: {_seconds(check.minute, p)}",
                    f"        alertname: {check.alertname}"]
            if not check.firing:
                out.append("        exp_alerts: []")
                continue
            out.append("        exp_alerts:")
            for f in check.firing:
                out.append("          - exp_labels:")
                out += [f"              {k}: {v}" for k, v in f.labels.items()]
                out += ["            exp_annotations:",
                        f"              summary: '{f.summary.format(**windows)}'",
                        f"              description: '{f.description.format(**windows)}'",
                        f"              runbook_url: {RUNBOOK}#{f.alertname.lower()}",
                        "              dashboard_url: http://localhost:3000/d/gpuscope-fleet"]
        if exprs:
            out.append("    promql_expr_test:")
        for check in exprs:
            out += [f"      - expr: '{MISSING}'", f"        eval_time: {_seconds(check.minute, p)}"]
            if not check.pending_or_firing:
                out.append("        exp_samples: []")
                continue
            out.append("        exp_samples:")
            for labels in check.pending_or_firing:
                out += [f"          - labels: 'ALERTS{{{_labels(labels)}}}'", "            value: 1"]
    return "\n".join(out) + "\n"


def outputs() -> dict[str, str]:
    paths = {"production": "tests/alerts/cases/targets.test.yml",
             "test": "tests/alerts/cases/test-profile/targets.test.yml"}
    return {paths[p.name]: render(p) for p in PROFILES}


def main() -> int:
    return case_files.write(outputs())


if __name__ == "__main__":
    raise SystemExit(main())
