"""alertmanager.yml: amtool validation and routing, and inhibition and grouping in a real Alertmanager."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpuscope.alerting import alertmanager, composite
from gpuscope.alerting.generate import alertmanager_path, all_alerts
from gpuscope.contract.profiles import PROFILES, TEST
from tests.alerts.conftest import Alertmanager, Sink, start_alertmanager
from tests.conftest import require_binary, wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distro
CONFIGS = [alertmanager_path(p) for p in PROFILES.values()]
ROUTE_CASES = yaml.safe_load((ROOT / "tests/alerts/cases/routes.yml").read_text())["cases"]


@pytest.mark.parametrize("config", CONFIGS)
def test_amtool_accepts_the_config(config: str) -> None:
    result = subprocess.run([require_binary("amtool"), "check-config", str(ROOT / config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: c["labels"].get("alertname"))
def test_routes(config: str, case: dict) -> None:
    labels = [f"{k}={v}" for k, v in case["labels"].items()]
    result = subprocess.run(
        [require_binary("amtool"), "config", "routes", "test", f"--config.file={ROOT / config}",
         f"--verify.receivers={case['receiver']}", *labels],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{case}: {result.stdout}{result.stderr}"


def test_every_generated_alert_routes_by_its_severity() -> None:
    """Each alert's severity picks a receiver; no alert falls through to the default by accident."""
    route = alertmanager.config(TEST)["route"]
    for alert in all_alerts(TEST):
        severity = [f'severity="{alert.severity}"']
        matched = [r["receiver"] for r in route["routes"] if r["matchers"] == severity]
        assert matched == [alertmanager.RECEIVERS[alert.severity]], alert.name
        services = [m for r in route["routes"] for sub in r["routes"] for m in sub["matchers"]]
        assert f'service="{alert.service}"' in services, alert.name


def _matches(matcher: str, labels: dict[str, str]) -> bool:
    import re

    name, op, value = re.fullmatch(r'(\w+)(=~|=)"(.*)"', matcher).groups()
    actual = labels.get(name, "")
    return re.fullmatch(value, actual) is not None if op == "=~" else actual == value


def test_inhibition_matchers_are_disjoint() -> None:
    """No generated alert matches both sides of a rule, so none can silence itself or its peers."""
    for rule in alertmanager.config(TEST)["inhibit_rules"]:
        for alert in all_alerts(TEST):
            labels = {"alertname": alert.name, "severity": alert.severity}
            source = all(_matches(m, labels) for m in rule["source_matchers"])
            target = all(_matches(m, labels) for m in rule["target_matchers"])
            assert not (source and target), (rule, alert.name)


def test_composite_inhibits_exactly_its_components() -> None:
    rule = alertmanager.config(TEST)["inhibit_rules"][0]
    names = {a.name for a in all_alerts(TEST)}
    targets = {n for n in names if _matches(rule["target_matchers"][0], {"alertname": n})}
    assert targets == {n for group in composite.COMPONENTS.values() for n in group}
    assert rule["equal"] == ["instance"]


# --- a real Alertmanager -----------------------------------------------------------------------------

A, B, GPU_HOST = "server:8000", "server:8001", "gpu-host:9400"


def _alert(name: str, severity: str, service: str, **labels: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, "service": service, **labels},
            "annotations": {"summary": name}}


def _server(name: str, severity: str, instance: str, **labels: str) -> dict:
    return _alert(name, severity, "gpuscope-server", job="gpuscope-server", instance=instance, **labels)


def _gpu(name: str, severity: str, gpu: str) -> dict:
    return _alert(name, severity, "gpuscope-exporter", job="gpuscope-exporter", instance=GPU_HOST, gpu=gpu)


@pytest.fixture
def am(sink: Sink, tmp_path: Path) -> Iterator[Alertmanager]:
    # The test profile's timing (group_wait 10 s), with the receiver swapped for the local sink.
    yield from start_alertmanager(alertmanager.render(TEST, receiver_url=sink.url), tmp_path)


def _frozen(note: tuple[str, str, list[str]]) -> tuple:
    return (note[0], note[1], tuple(note[2]))


def _state(am: Alertmanager) -> dict[tuple[str, str, str], str]:
    """(alertname, instance, gpu) → 'inhibited' or 'active'."""
    return {(a["labels"]["alertname"], a["labels"].get("instance", ""), a["labels"].get("gpu", "")):
            ("inhibited" if a["status"]["inhibitedBy"] else a["status"]["state"]) for a in am.alerts()}


def test_inhibition_and_grouping_in_alertmanager(am: Alertmanager, sink: Sink) -> None:
    # Components first, as Prometheus may send them; the composite right after, within group_wait.
    am.post([_server("GPUKernelLatencySpike", "warning", A, op="matmul", device="cuda:0"),
             _server("GPUMemoryLeak", "warning", A, device="cuda:0"),
             _server("GPUTenantQueueWaitHigh", "warning", A, tenant="t1"),
             _gpu("GPUThermalThrottling", "warning", "1"),
             _gpu("GPUThermalThrottling", "warning", "0")])
    am.post([_server(composite.COMPOSITE, "critical", A), _gpu("GPULost", "critical", "1")])
    # Posted last, so its group is flushed last: once it is delivered, A's groups have been too.
    am.post([_server("GPUKernelLatencySpike", "warning", B, op="matmul", device="cuda:0")])

    expected = {
        ("GPUKernelLatencySpike", A, ""): "inhibited",    # composite silences its components
        ("GPUMemoryLeak", A, ""): "inhibited",
        ("GPUTenantQueueWaitHigh", A, ""): "inhibited",   # critical silences warning, same instance
        (composite.COMPOSITE, A, ""): "active",
        ("GPUKernelLatencySpike", B, ""): "active",       # other instance: untouched
        ("GPULost", GPU_HOST, "1"): "active",
        ("GPUThermalThrottling", GPU_HOST, "1"): "inhibited",  # critical on the same GPU
        ("GPUThermalThrottling", GPU_HOST, "0"): "active",     # another GPU on the same host
    }
    wait_for(lambda: _state(am) == expected, timeout=15, what="inhibition states")

    groups = {(g["receiver"]["name"], tuple(sorted(g["labels"].items()))):
              sorted(a["labels"]["alertname"] for a in g["alerts"]) for g in am.groups()}
    assert groups[("gpuscope-page", (("alertname", composite.COMPOSITE), ("instance", A)))] == [
        composite.COMPOSITE]
    for name in ("GPUKernelLatencySpike", "GPUMemoryLeak", "GPUTenantQueueWaitHigh"):  # one group a name
        assert groups[("gpuscope-ticket", (("alertname", name), ("instance", A)))] == [name]
    assert groups[("gpuscope-ticket", (("alertname", "GPUThermalThrottling"), ("gpu", "0"),
                                       ("instance", GPU_HOST)))] == ["GPUThermalThrottling"]
    assert groups[("gpuscope-page", (("alertname", "GPULost"), ("gpu", "1"), ("instance", GPU_HOST)))] == [
        "GPULost"]

    def delivered() -> list[tuple[str, str, list[str]]]:
        return [(n["receiver"], n["groupLabels"].get("instance", ""),
                 sorted(a["labels"]["alertname"] for a in n["alerts"])) for n in sink.received()]

    # Every group was created within milliseconds and flushes after group_wait: wait for the two
    # that must arrive; by then A's inhibited ticket groups have had their turn too.
    wait_for(lambda: {("gpuscope-ticket", B, ("GPUKernelLatencySpike",)),
                      ("gpuscope-page", A, (composite.COMPOSITE,))} <= set(map(_frozen, delivered())),
             timeout=TEST.notify.group_wait * 3, what="the page for A and the ticket for B")
    sent = delivered()
    assert not [n for n in sent if n[0] == "gpuscope-ticket" and n[1] == A], sent
    ticket_gpus = [n["groupLabels"].get("gpu") for n in sink.received()
                   if n["receiver"] == "gpuscope-ticket" and n["groupLabels"].get("instance") == GPU_HOST]
    assert ticket_gpus == ["0"], sink.received()
