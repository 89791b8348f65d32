"""The alert scenario runner: reading alerts back, and a shortened run against the no-Docker stack."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from gpuscope.loadtest import fault_drill as alerts
from gpuscope.loadtest.alertwatch import distinct, firing, first_of, groups_resolved, parse_time, rule_for_s

from ..conftest import require_binary, usage_error, wait_for


def _record(at, status, group, *alerts_):
    return {"received_at": at, "notification": {"status": status, "groupKey": group, "alerts": [
        {"status": s, "labels": {"alertname": name, "instance": "i1"}, "startsAt": "2026-01-01T00:00:10.5Z"}
        for name, s in alerts_]}}


RECORDS = [
    _record(100.0, "firing", "g1", ("GPUTenantQueueWaitHigh", "firing")),
    _record(130.0, "firing", "g1", ("GPUTenantQueueWaitHigh", "firing"), ("GPUTenantStarved", "firing")),
    _record(160.0, "resolved", "g1", ("GPUTenantQueueWaitHigh", "resolved"),
            ("GPUTenantStarved", "resolved")),
]


def test_first_expected_alert_after_the_fault_start():
    hit = first_of(RECORDS, ["GPUTenantStarved", "GPUServiceDegraded"], since=90.0)
    assert hit is not None and hit.alertname == "GPUTenantStarved" and hit.received_at == 130.0
    assert hit.starts_at == parse_time("2026-01-01T00:00:10.5+00:00")
    assert first_of(RECORDS, ["GPUTenantStarved"], since=131.0) is None


def test_repeated_notifications_of_one_alert_count_once():
    seen = firing(RECORDS, 0.0)
    assert [s.alertname for s in seen] == ["GPUTenantQueueWaitHigh", "GPUTenantQueueWaitHigh",
                                          "GPUTenantStarved"]
    assert sorted(s.alertname for s in distinct(seen)) == ["GPUTenantQueueWaitHigh", "GPUTenantStarved"]
    assert firing(RECORDS, 0.0, until=100.0) == []


def test_quiet_needs_every_group_resolved_last():
    assert groups_resolved(RECORDS)
    assert not groups_resolved([*RECORDS, _record(170.0, "firing", "g2", ("GPUMemoryLeak", "firing"))])


def test_alertmanager_times_with_nanoseconds_parse():
    assert parse_time("2026-01-01T00:00:00.123456789Z") == pytest.approx(parse_time("2026-01-01T00:00:00Z")
                                                                         + 0.123456)
    assert parse_time("0001-01-01T00:00:00Z") is None


def test_unknown_scenario_is_one_line():
    line = usage_error("gpuscope.loadtest.fault_drill", "--scenarios", "meteor")
    assert "unknown scenario 'meteor'" in line


def _require_stack_binaries() -> None:
    require_binary("prometheus")
    for debian, upstream in (("prometheus-alertmanager", "alertmanager"),
                             ("prometheus-node-exporter", "node_exporter")):
        if shutil.which(upstream) is None:
            require_binary(debian)


@pytest.mark.slow
@pytest.mark.distro
@pytest.mark.timeout(600)
def test_shortened_run_detects_starvation_and_stays_quiet_under_steady_load(tmp_path):
    """CI's version of the full run (benchmarks/results/alerts-cpu.json): one fault, 40 s of steady load."""
    _require_stack_binaries()
    output = tmp_path / "alerts.json"
    progress = io.StringIO()
    code = alerts.main(["--scenarios", "starvation", "--warmup", "20s", "--steady", "40s",
                        "--detect-timeout", "180s", "--quiet-timeout", "180s", "--output", str(output),
                        "--run-dir", str(tmp_path / "run")], out=progress)
    report = json.loads(output.read_text())
    assert {"date", "detection_latency_s", "composite_detection_latency_s", "false_alerts_steady",
            "steady_minutes"} <= report.keys()
    assert report["false_alerts_steady"] == 0, report["false_alert_names"]
    assert report["steady_minutes"] == pytest.approx(40 / 60, abs=0.01)
    starvation = report["scenarios"]["starvation"]
    assert starvation["raised"] in ("GPUTenantStarved", "GPUTenantUnderServed", "GPUServiceDegraded")
    latency = report["detection_latency_s"]["starvation"]
    # Within the rule's window + for + two evaluation intervals + group_wait, plus one group_interval
    # of slack for an inhibiting composite that resolves first, and one for the 2-core CI machine.
    bound = starvation["target_with_window_s"] + 30 + 30
    assert latency is not None and latency <= bound, progress.getvalue()
    assert code == 0, progress.getvalue()


def test_the_rule_that_fired_is_found_by_its_labels():
    rules = [{"name": "GPUServiceErrorBudgetBurn", "duration": 20, "labels": {"severity": "critical"}},
             {"name": "GPUServiceErrorBudgetBurn", "duration": 240, "labels": {"severity": "warning"}},
             {"name": "GPUMemoryLeak", "duration": 120, "labels": {"severity": "warning"}}]
    assert rule_for_s(rules, "GPUServiceErrorBudgetBurn", {"severity": "warning", "instance": "x"}) == 240
    assert rule_for_s(rules, "GPUServiceErrorBudgetBurn", {"severity": "critical"}) == 20
    assert rule_for_s(rules, "GPUMemoryLeak") == 120
    assert rule_for_s(rules, "Nope") == 0


def test_every_alert_a_scenario_accepts_has_an_evidence_window_in_the_config():
    from gpuscope.contract.profiles import TEST

    accepted = {name for scenario in alerts.SCENARIOS.values() for name in scenario.alerts}
    windows = {name: alerts.evidence_s(name, {"severity": "critical"}) or alerts.evidence_s(name)
               for name in accepted}
    assert all(windows.values()), windows  # every one watches a window
    assert windows["GPUTenantStarved"] == TEST.windows.starvation
    assert windows["GPUMemoryLeak"] == TEST.windows.leak
    assert windows["GPUServiceDegraded"] == max(TEST.windows.latency, TEST.windows.leak,
                                                TEST.windows.starvation)
    # A page and a ticket share a name: the alert's severity picks the rule.
    burn = "GPUServiceErrorBudgetBurn"
    assert alerts.evidence_s(burn, {"severity": "critical"}) == TEST.windows.slo_long_fast
    assert alerts.evidence_s(burn, {"severity": "warning"}) == TEST.windows.slo_ticket_long


@pytest.mark.slow
def test_stopping_the_drills_load_keeps_locusts_reports(paced_server, tmp_path):
    """The drill stops Locust mid-run (its run time is the whole drill's budget): Locust must still
    write its HTML report and the samples. With gpuscope's load shape it does so on SIGINT only."""
    paced_server.hold_after = 4  # users end up in held streams: Locust is mid-run when it is stopped
    locust = alerts._start_locust(paced_server.url, 2, 600, tmp_path)
    killed = []
    try:
        wait_for(lambda: len(paced_server.held) == 2 or not locust.running, timeout=120,
                 what="both users in a held stream")
        assert locust.running, locust.tail()
    finally:
        locust.stop(on_kill=killed.append)
    assert not killed, locust.tail()
    assert (tmp_path / "locust.html").stat().st_size > 0, locust.tail()
    samples = json.loads((tmp_path / "samples.json").read_text())
    assert len(samples["requests"]) >= 4


class _FakeServer:
    """The parts of procs.Child the drill's restart uses, recording the order of calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def stop(self, stop_signal=None, grace_s=None):
        self.calls.append(("stop", stop_signal))

    def poll(self):
        return -9

    def start(self):
        self.calls.append(("start",))
        return self

    def wait_ready(self, timeout_s):
        self.calls.append(("wait_ready",))


def test_restart_kills_the_server_and_waits_until_it_answers_again():
    import signal

    server = _FakeServer()
    out = io.StringIO()
    result = alerts.restart_server(server, out)
    assert server.calls == [("stop", signal.SIGKILL), ("start",), ("wait_ready",)]
    assert result["down_s"] >= 0 and "ready again" in out.getvalue()


def test_the_restart_falls_in_the_middle_of_the_steady_window():
    import time

    started = time.monotonic()
    at: list[float] = []
    result = alerts.steady_window(0.4, lambda: at.append(time.monotonic() - started) or {"down_s": 0.0},
                                  io.StringIO())
    assert result == {"down_s": 0.0} and len(at) == 1
    assert 0.2 <= at[0] < 0.4 and time.monotonic() - started >= 0.4
    assert alerts.steady_window(0.05, None, io.StringIO()) is None


def test_the_alerts_a_restart_may_raise_are_the_server_down_alert_of_the_rules():
    from gpuscope.alerting.generate import all_alerts
    from gpuscope.contract.profiles import TEST

    down = {a.name for a in all_alerts(TEST) if a.expr.endswith("== 0") and a.name.startswith("GPUServer")}
    assert down == alerts.RESTART_ALERTS
