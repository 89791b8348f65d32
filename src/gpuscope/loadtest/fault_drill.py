"""``python -m gpuscope.loadtest.fault_drill``: prove the alert rules under load, without Docker.

It starts the no-Docker stack (``gpuscope stack``'s context manager) with the
test alerting profile and fault injection enabled, puts steady streaming load
on the server with Locust (two tenants, so one can be starved), and then:

1. warm-up (``--warmup``): history for the latency baselines; alerts seen here
   are reported, not counted;
2. steady load (``--steady``): every alert that reaches the receiver counts as
   a false alert (target: zero). Half-way through, the server process is killed
   (SIGKILL) and started again on the same address (``--restart``, on by
   default): its series keep their labels, counters reset, memory warms up
   again. Only the server-down alert may come of it (``RESTART_ALERTS``);
3. each fault in turn: inject it through ``POST /admin/faults/NAME``, wait for
   its alert at the receiver, clear the fault, and wait until Prometheus,
   Alertmanager and the receiver are quiet again before the next one. The
   composite injects a latency spike and a memory leak together and waits for
   ``GPUServiceDegraded``.

Detection latency is fault start → first notification of the expected alert at
the receiver. Alongside, the report gives when Alertmanager says the alert
started firing and two targets:

- ``target_s``: the rule's ``for`` plus two evaluation intervals (the drill's first target);
- ``target_with_window_s``: that, plus the rule's evidence window (``Alert.evidence_s``: the range
  its expression must see the fault over before it can be true, 20 s without tokens for
  starvation, the floor's growth over 5 min for the leak) plus Alertmanager's ``group_wait``. A windowed
  rule cannot beat its window, and shortening windows is what the steady run's zero false alerts
  would pay for.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gpuscope.alerting.generate import all_alerts
from gpuscope.contract.choices import AlertProfile, ServerSource
from gpuscope.contract.profiles import TEST
from gpuscope.loadtest import runtools
from gpuscope.loadtest.alertwatch import AlertSources, Seen, distinct, firing, first_of, rule_for_s
from gpuscope.loadtest.runtools import duration_arg
from gpuscope.ops import procs
from gpuscope.ops.stack import Stack, StackOptions
from gpuscope.util.settings import SettingsParser, parser_for, setting

PROG = "gpuscope drill"
SERVER_TENANTS = "alpha:0.5,beta:0.5"
LOAD_TENANTS = "alpha:1,beta:1"
STARVED_TENANT = "beta"
_MIB = 1 << 20
#: How long Locust may take to stop its users and write its reports after SIGINT.
LOCUST_GRACE_S = 30.0
#: Alerts a server restart may raise in the steady window (the test profile's GPUServerDown needs the
#: server unscraped for 20 s, which a slow start on a busy machine can reach); any other is false.
RESTART_ALERTS = frozenset({"GPUServerDown"})
#: Longest wait for the restarted server to answer /readyz.
RESTART_READY_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Scenario:
    """Faults to inject together, and the alerts that count as detecting them (first listed is expected)."""

    name: str
    faults: dict[str, dict[str, Any]]
    alerts: tuple[str, ...]


#: The composite inhibits its component alerts on the same instance (alerts/alertmanager.yml), so a
#: single fault whose composite fires reaches people as GPUServiceDegraded: that counts as detected,
#: and the report names which alert it was (a composite on one fault means a second dimension moved).
COMPOSITE = "GPUServiceDegraded"
_LEAK = {"rate_bytes_per_s": 4 * _MIB, "max_bytes": 4096 * _MIB}

#: Every scenario the runner knows; the fault bodies are what the server's admin API takes.
#: 4 MiB/s predicts the host's memory gone within the rule's 4 h horizon on machines up to ~56 GB,
#: and stays under max_bytes for the whole detection window.
SCENARIOS: dict[str, Scenario] = {
    "starvation": Scenario("starvation", {"starvation": {"tenant": STARVED_TENANT}},
                           ("GPUTenantStarved", "GPUTenantUnderServed", COMPOSITE)),
    "error_burst": Scenario("error_burst", {"error_burst": {"log_lines_per_s": 5, "error_ratio": 1.0}},
                            ("GPUServiceErrorBudgetBurn",)),
    "latency_spike": Scenario("latency_spike", {"latency_spike": {"extra_passes": 8}},
                              ("GPUKernelLatencySpike", COMPOSITE)),
    "memory_leak": Scenario("memory_leak", {"memory_leak": _LEAK}, ("GPUMemoryLeak", COMPOSITE)),
    "composite": Scenario("composite", {"latency_spike": {"extra_passes": 8}, "memory_leak": _LEAK},
                          (COMPOSITE,)),
}


def evidence_s(alertname: str, labels: dict[str, str] | None = None) -> float:
    """The test profile's ``Alert.evidence_s`` of the rule that raised an alert (same name, and its
    severity where the alert has one: a page and a ticket can share a name)."""
    candidates = [a for a in all_alerts(TEST) if a.name == alertname
                  and (labels or {}).get("severity", a.severity) == a.severity]
    return float(min((a.evidence_s for a in candidates), default=0))


#: ``--source vllm``: the server exposes vLLM's metrics and the rules read them through the vLLM source.
#: Its latency dimension is the inter-token latency; a starved tenant shows only as a stalled model, so
#: the load comes from the starved tenant alone; vLLM has no memory series for a leak to move, and its
#: two remaining dimensions (step latency, a stalled model) exclude each other on one model, so the
#: memory_leak and composite scenarios have nothing to detect (docs/sources.md).
VLLM_SCENARIOS = {**{name: SCENARIOS[name] for name in ("starvation", "error_burst")},
                  "latency_spike": Scenario("latency_spike", {"latency_spike": {"extra_passes": 16}},
                                            ("GPUStepLatencySpike", COMPOSITE))}
VLLM_ORDER = ("latency_spike", "starvation", "error_burst")
#: vLLM's inter-token buckets start at 10 ms, so the one-layer toy model's steps, spiked or not, all
#: land in the first: the vLLM drill serves a model whose decode step on CPU takes about that long,
#: and whose spiked step clears the spike ratio in vLLM's coarser buckets (docs/loadtest.md, "Alerts
#: proven under load", gives the steps measured), as a real model's does on a GPU.
VLLM_SERVER_ARGS = "--model.layers 2 --model.dim 1024"
DEFAULT_SERVER_ARGS = "--model.layers 1"
VLLM_LOAD_TENANTS = f"{STARVED_TENANT}:1"
VLLM_OUTPUT = "benchmarks/results/alerts-vllm-cpu.json"
DEFAULT_OUTPUT = "benchmarks/results/alerts-cpu.json"

FAULT_SCENARIOS = ("latency_spike", "memory_leak", "starvation", "error_burst")
#: error_burst last: its slow-burn ticket (1× budget over the test profile's 24 min window) keeps
#: firing long after the burst, as an SLO alert should, and would hold up every later scenario.
DEFAULT_ORDER = ("latency_spike", "memory_leak", "starvation", "composite", "error_burst")


@dataclass(frozen=True)
class DrillSettings:
    """The flags of ``gpuscope drill``; None: the source's own default (gpuscope's or vLLM's)."""

    scenarios: str | None = setting(
        "--scenarios", None, f"scenarios in order, comma-separated ({', '.join(SCENARIOS)}); empty for none "
        f"(default {','.join(DEFAULT_ORDER)}; with --source vllm {','.join(VLLM_ORDER)})")
    warmup: float = setting("--warmup", 60.0, "load before the steady window (not counted)",
                            parse=duration_arg)
    steady: float = setting("--steady", 600.0, "steady window counting false alerts (10m)",
                            parse=duration_arg)
    restart: bool = setting("--restart", True, "kill the server (SIGKILL) half-way through the steady window "
                            "and start it again; only the server-down alert may follow")
    users: int = setting("--users", 2, "Locust users (closed loop); small on small machines")
    detect_timeout: float = setting("--detect-timeout", 420.0, "longest wait for a fault's alert",
                                    parse=duration_arg)
    quiet_timeout: float = setting("--quiet-timeout", 420.0, "longest wait for quiet after a fault",
                                   parse=duration_arg)
    server_args: str | None = setting(
        "--server.args", None, "extra gpuscope serve flags (tenants and faults are set by the runner; "
        f"default {DEFAULT_SERVER_ARGS!r}, with --source vllm {VLLM_SERVER_ARGS!r})")
    output: str | None = setting("--output", None, f"JSON report path (default {DEFAULT_OUTPUT}; "
                                 f"{VLLM_OUTPUT} with --source vllm)")
    source: ServerSource = setting(
        "--source", ServerSource.GPUSCOPE, "the server's metrics: gpuscope's, or vllm (vLLM's names, read "
        f"through the vLLM source; scenarios {', '.join(VLLM_ORDER)})")
    run_dir: str = setting("--run-dir", "", "keep the stack's configs, logs and Locust's report here")


def build_parser() -> SettingsParser[DrillSettings]:
    return parser_for(DrillSettings, prog=PROG,
                      description="Induce each fault under steady load and time its alert.")


def _say(out: TextIO, text: str) -> None:
    out.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")
    out.flush()


def _request(method: str, url: str, token: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"{}")


def poll(check: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """``check()`` until it returns something truthy or the deadline passes (then its last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except (urllib.error.URLError, OSError):
            value = None  # a part briefly busy under load: ask again
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def restart_server(server: procs.Child, out: TextIO) -> dict[str, Any]:
    """SIGKILL the server and start it again (same command, same address); how long it was gone."""
    killed_at = time.time()
    server.stop(signal.SIGKILL, grace_s=10.0)
    _say(out, f"restart: server killed (exit {server.poll()}); starting it again")
    server.start()
    server.wait_ready(RESTART_READY_TIMEOUT_S)
    down_s = round(time.time() - killed_at, 1)
    _say(out, f"restart: server ready again after {down_s} s")
    return {"killed_at": killed_at, "down_s": down_s}


def steady_window(seconds: float, restart: Callable[[], dict[str, Any]] | None, out: TextIO
                  ) -> dict[str, Any] | None:
    """The steady window, with ``restart()`` run half-way through it when given; its result."""
    end = time.monotonic() + seconds
    if restart is None:
        _countdown(seconds, out)
        return None
    _countdown(seconds / 2, out)
    result = restart()
    _countdown(max(0.0, end - time.monotonic()), out)
    return result


def run_scenario(scenario: Scenario, server: str, token: str, sources: AlertSources,
                 rules: list[dict[str, Any]], interval: float, group_wait: float, settings: DrillSettings,
                 out: TextIO, last: bool = False) -> dict[str, Any]:
    """Inject, wait for the alert, clear, wait for quiet (unless nothing follows); its part of the report."""
    fault_duration = settings.detect_timeout + 60.0  # the server ends the fault itself if we die
    started = time.time()
    for fault, params in scenario.faults.items():
        _request("POST", f"{server}/admin/faults/{fault}", token, {"duration_s": fault_duration, **params})
    _say(out, f"{scenario.name}: injected {', '.join(scenario.faults)}; waiting for {scenario.alerts[0]}")
    hit: Seen | None = poll(lambda: first_of(sources.notifications(), scenario.alerts, started),
                            settings.detect_timeout)
    during = distinct(firing(poll(sources.notifications, 30) or [], started))
    for fault in scenario.faults:
        _request("DELETE", f"{server}/admin/faults/{fault}", token)
    alertname = hit.alertname if hit else scenario.alerts[0]
    expected_for = rule_for_s(rules, alertname, hit.labels if hit else None)
    window = evidence_s(alertname, hit.labels if hit else None)
    target = expected_for + 2 * interval
    target_with_window = window + target + group_wait
    latency = round(hit.received_at - started, 1) if hit else None
    result = {
        "expected": list(scenario.alerts),
        "raised": hit.alertname if hit else None,
        "detection_latency_s": latency,
        "firing_latency_s": round(hit.starts_at - started, 1) if hit and hit.starts_at else None,
        "rule_for_s": expected_for,
        "evidence_window_s": window,
        "target_s": target,
        "within_target": latency is not None and latency <= target,
        "target_with_window_s": target_with_window,
        "within_target_with_window": latency is not None and latency <= target_with_window,
        "alerts_during": sorted({s.alertname for s in during}),
    }
    if hit:
        _say(out, f"{scenario.name}: {hit.alertname} at the receiver after {result['detection_latency_s']} s "
                  f"(firing after {result['firing_latency_s']} s)")
    else:
        _say(out, f"{scenario.name}: no alert within {settings.detect_timeout:.0f} s")
    if last:
        result["quiet_after_s"] = None  # nothing follows: no need to wait out slow-burn windows
        return result
    quiet_started = time.monotonic()
    quiet = poll(sources.quiet, settings.quiet_timeout, 2.0)
    result["quiet_after_s"] = round(time.monotonic() - quiet_started, 1) if quiet else None
    _say(out, f"{scenario.name}: " + ("quiet again" if quiet else "still alerting after the quiet timeout"))
    return result


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    parser = build_parser()
    settings = parser.parse_settings(sys.argv[1:] if argv is None else argv)
    vllm = settings.source == ServerSource.VLLM
    known, load_tenants = (VLLM_SCENARIOS, VLLM_LOAD_TENANTS) if vllm else (SCENARIOS, LOAD_TENANTS)
    order = settings.scenarios if settings.scenarios is not None else ",".join(
        VLLM_ORDER if vllm else DEFAULT_ORDER)
    output = Path(settings.output or (VLLM_OUTPUT if vllm else DEFAULT_OUTPUT))
    extra_server_args = settings.server_args if settings.server_args is not None else (
        VLLM_SERVER_ARGS if vllm else DEFAULT_SERVER_ARGS)
    names = [s.strip() for s in order.split(",") if s.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r} for --source {settings.source} "
                     f"(one of: {', '.join(known)})")
    if settings.users < 2:
        parser.error("--users must be at least 2 (one per tenant)")
    if not runtools.locust_available():
        parser.error("locust is not installed (pip install 'gpuscope[loadtest]')")
    import shlex

    run_dir = Path(settings.run_dir or tempfile.mkdtemp(prefix="gpuscope-alerts-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    token_file = run_dir / "faults.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    server_args = [*shlex.split(extra_server_args), "--tenants", SERVER_TENANTS,
                   "--faults.enable", "--faults.token-file", str(token_file)]
    budget_s = settings.warmup + settings.steady + len(names) * (
        settings.detect_timeout + settings.quiet_timeout + 60)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    _say(out, f"starting the stack (test profile) in {run_dir}")
    with Stack(StackOptions(profile=AlertProfile.TEST, ports="free", server_args=server_args,
                            run_dir=run_dir / "stack", source=settings.source),
               log=lambda line: _say(out, line)) as stack:
        sources = AlertSources(stack.url("receiver"), stack.url("alertmanager"), stack.url("prometheus"))
        server = stack.url("server")
        rules, interval = sources.alert_rules()
        group_wait = _group_wait_s(run_dir / "stack" / "alertmanager.yml")
        locust = _start_locust(server, settings.users, budget_s, run_dir, load_tenants)
        try:
            _say(out, f"warm-up {settings.warmup:.0f} s with {settings.users} users")
            time.sleep(settings.warmup)  # load runs meanwhile; nothing to poll for
            warmup_alerts = distinct(firing(sources.notifications(), 0.0))
            steady_start = time.time()
            _say(out, f"steady load {settings.steady:.0f} s: counting alerts")
            restart = (lambda: restart_server(stack.processes["server"], out)) if settings.restart else None
            restarted = steady_window(settings.steady, restart, out)
            seen = distinct(firing(sources.notifications(), steady_start, time.time()))
            allowed = RESTART_ALERTS if restarted else frozenset()
            steady = [s for s in seen if s.alertname not in allowed]
            false_names = ", ".join(s.alertname for s in steady) or "none"
            of_restart = ", ".join(s.alertname for s in seen if s.alertname in allowed) or "none"
            _say(out, f"steady: {len(steady)} false alerts ({false_names})"
                      + (f"; of the restart: {of_restart}" if restarted else ""))
            results = {name: run_scenario(known[name], server, token, sources, rules, interval,
                                          group_wait, settings, out, last=i == len(names) - 1)
                       for i, name in enumerate(names)}
        finally:
            locust.stop()
    report = {
        "date": date,
        "detection_latency_s": {n: r["detection_latency_s"] for n, r in results.items()
                                if n in FAULT_SCENARIOS},
        "composite_detection_latency_s": results["composite"]["detection_latency_s"]
        if "composite" in results else None,
        "false_alerts_steady": len(steady),
        "steady_minutes": round(settings.steady / 60.0, 2),
        "false_alert_names": sorted(s.alertname for s in steady),
        "restart": None if restarted is None else {
            "at_s": round(restarted["killed_at"] - steady_start, 1), "down_s": restarted["down_s"],
            "alerts": sorted({s.alertname for s in seen if s.alertname in RESTART_ALERTS})},
        "alerts_during_warmup": sorted({s.alertname for s in warmup_alerts}),
        "scenarios": results,
        "evaluation_interval_s": interval,
        "group_wait_s": group_wait,
        "profile": AlertProfile.TEST,
        "source": settings.source,
        "machine": runtools.describe_machine(),
        "load": {"users": settings.users, "tenants": load_tenants, "server_args": " ".join(server_args),
                 "warmup_s": settings.warmup},
        "command": " ".join([PROG, *(sys.argv[1:] if argv is None else argv)]),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    _say(out, f"wrote {output}")
    missed = [n for n, r in results.items() if r["detection_latency_s"] is None]
    return 1 if missed or steady else 0


def _group_wait_s(alertmanager_yml: Path) -> float:
    import yaml

    route = yaml.safe_load(alertmanager_yml.read_text()).get("route", {})
    text = str(route.get("group_wait", "30s"))
    return duration_arg(text)


def _start_locust(server: str, users: int, budget_s: float, run_dir: Path,
                  tenants: str = LOAD_TENANTS) -> procs.Child:
    """Steady load for at most the whole run's budget: it stops by itself even if we never stop it.

    Stopped with SIGINT, as Ctrl-C does: with a load shape (gpuscope's locustfile always has one)
    Locust handles SIGTERM only after the shape has ended, so SIGTERM would kill it before it writes
    ``locust.html`` and the samples. In its own session, so a Ctrl-C at the terminal reaches the
    runner only, which then stops Locust once, through here."""
    command = [*runtools.locust_prefix(), "-f", str(runtools.LOCUSTFILE), "--headless", "--only-summary",
               "--host", server, "-u", str(users), "-r", str(users), "-t", f"{budget_s:.0f}s",
               "--output-tokens", "uniform:min=8,max=32", "--html", str(run_dir / "locust.html"),
               "--samples-file", str(run_dir / "samples.json")]
    env = {**os.environ, "GPUSCOPE_LOAD_TENANTS": tenants, "PYTHONUNBUFFERED": "1"}
    return procs.Child(command, name="locust", env=env, log_path=run_dir / "locust.log",
                       stop_signal=signal.SIGINT, grace_s=LOCUST_GRACE_S, new_session=True,
                       die_with_parent=True, signal_again=runtools.locust_ignored_ctrl_c).start()


def _countdown(seconds: float, out: TextIO) -> None:
    """Sleep through a window, saying how much is left every minute (it is a fixed window, not a wait)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(60.0, left))
        if end - time.monotonic() > 1:
            _say(out, f"  {end - time.monotonic():.0f} s left")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM (and SIGINT, which shells ignore in background jobs) unwind through the finally
    # blocks, so Locust and every part of the stack stop with the runner.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    raise SystemExit(main())
