"""Memory shapes for the leak rules, written as promtool unit tests for both alert profiles.

``python -m tests.alerts.memory_shapes`` rewrites ``tests/alerts/cases/memory.test.yml`` (production) and
``tests/alerts/cases/test-profile/memory.test.yml``; ``tests/alerts/test_rules.py`` fails when either is
stale. Each shape is one function of time, in production minutes and fractions of an 80 GiB device,
so both profiles see the same shape: the test profile's file compresses time 15× (scrape interval,
evaluation times) and keeps the values. Horizons that are thresholds (``leak_horizon_s``) are not
compressed, so a compressed leak runs out 15× sooner in real time; where that changes what an alert
says, the expectation is given per profile.

Leaks must fire (checked silent just before, firing with full labels and annotations after):

- ``leak``: 40 GiB + 15 GiB/h from the series' first sample (out of memory at 160m);
- ``steps``: 70% for an hour, then +1% of capacity every 10 minutes (out of memory at 360m);
- ``cycles``: 10-minute allocate/free cycles (+25% in 3 min, held 5, freed in 2) whose floor rises
  1.5% a cycle from 60m (their peaks reach capacity at ~233m);
- ``noisy``: 50%, then +10%/h from 60m, with ±1% allocation noise on 30-second scrapes (360m);
- ``fast``: 40% for an hour, then +3% a minute (out of memory at 80m): GPUMemoryRunningOut;
- ``early``: a leak from the process's first minute, 0 → 100% in 30 minutes: GPUMemoryRunningOut
  (``trigger="climbing"``) with about 9 minutes left, then ``near_full`` with about a minute left,
  though the process is younger than the warm-up guard;
- ``young``: a process that starts at 40% and grows 3% of capacity a minute (out of memory at 20m):
  ``trigger="climbing"`` pages at least 5 minutes before exhaustion (``tests/alerts/leak_envelope.py``
  measures which other linear leaks do).

Healthy shapes must stay silent at every check (every 5 minutes for 6 hours, all four alerts):

- ``warmup``: 2 GB → 52 GB in 20 minutes, then flat;
- ``sawtooth``: 10 → 20 GB allocate/free in 5-minute cycles;
- ``creep``: warm-up to 90% in 10 minutes, then creeping towards 95% (never above it, τ = 1 h);
- ``warm95``: warm-up to 95% in 10 minutes, then +1 MiB a minute (68 hours to exhaustion);
- ``saw60``: a 60-minute allocate/free sawtooth 30% → 70% with constant peaks;
- ``plateau``: 90% with ±1% noise on 30-second scrapes;
- ``surge``: a traffic peak, 40% → 80% in 5 minutes at 60m, held 20 minutes, back in 5;
- ``cycles15``: 15-minute allocate/free cycles from the start, 20% → 88% in 14 minutes, flushed in 1:
  every climb would exhaust memory within minutes, but returns to the same peak;
- ``cycles60``: hourly cycles, 30% → 88% in 25 minutes, held 25, freed in 10;
- ``cache95``: 15-minute cycles of a cache that fills up to 95% (40% → 95% in 10 minutes, held 2,
  freed in 3): through 90% every time, never above its first peak;
- ``restart``: the ``warmup`` working set, the process killed at 120m (two missed scrapes), then
  the same warm-up again under the same labels;
- ``redeploy``: 40% for two hours, a restart (one missed scrape) and a warm-up to 88% in 15 minutes,
  above every earlier peak: the restart starts the warm-up guard again.

Server only (a GPU's framebuffer has no process start time):

- ``reload``: 40% for two hours, a restart that loads its 40% within the missed scrape, then a
  warm-up to 70% in 15 minutes: memory never falls, so only the changed ``process_start_time_seconds``
  in the scrape tells the warm-up guard that the process is new.

Every server series comes with the process's ``process_start_time_seconds``, which changes where a
shape restarts.

A restart's missed scrapes end the series (a staleness marker, as Prometheus writes when a scrape
fails) until the new process answers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.alerts import case_files

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = 80 << 30
MIB = 1 << 20
SERVER = 'job="gpuscope-server"'
EXPORTER = 'job="gpuscope-exporter"'
GPU_HOST = "gpu-host:9400"
RUNBOOK = "https://github.com/gpuscope/gpuscope/blob/main/docs/runbooks.md"
GRAFANA = "http://localhost:3000/d/gpuscope-fleet"


@dataclass(frozen=True)
class Profile:
    name: str
    compression: int
    evaluation_interval_s: int
    path: str
    rules: str  # the folder of the profile's rule files, relative to the test file


PROFILES = (
    Profile("production", 1, 30, "tests/alerts/cases/memory.test.yml",
            "../../../alerts/prometheus/production"),
    Profile("test", 15, 5, "tests/alerts/cases/test-profile/memory.test.yml",
            "../../../../alerts/prometheus/test"),
)


# --- shapes: production minutes → fraction of capacity -------------------------------------------------

def _noise(seed: int) -> Callable[[float], float]:
    """±1% of capacity, uniform, fixed per sample time (the same in both profiles)."""
    rng, drawn = random.Random(seed), {}

    def at(t: float) -> float:
        if t not in drawn:
            drawn[t] = rng.uniform(-0.01, 0.01)
        return drawn[t]
    return at


def leak(t: float) -> float:
    return min(40 / 80 + 15 / 80 * t / 60, 1.0)


def steps(t: float) -> float:
    return 0.70 if t < 60 else min(0.70 + 0.01 * (math.floor((t - 60) / 10) + 1), 1.0)


def cycles(t: float) -> float:
    def floor(k: int) -> float:
        return 0.50 + 0.015 * max(0, k - 6)
    k = math.floor(t / 10)
    phase, low, high = t - 10 * k, floor(k), floor(k) + 0.25
    if phase < 3:
        return low + (high - low) * phase / 3
    if phase < 8:
        return high
    return high + (floor(k + 1) - high) * (phase - 8) / 2


_NOISY = _noise(4)
_PLATEAU = _noise(6)


def noisy(t: float) -> float:
    return (0.50 if t < 60 else 0.50 + 0.10 * (t - 60) / 60) + _NOISY(t)


def fast(t: float) -> float:
    return 0.40 if t < 60 else min(0.40 + 0.03 * (t - 60), 1.0)


def early(t: float) -> float:
    return min(t / 30, 1.0)


def young(t: float) -> float:
    return min(0.40 + 0.03 * t, 1.0)


def warmup(t: float) -> float:
    return (2e9 + 2.5e9 * min(t, 20)) / CAPACITY


def sawtooth(t: float) -> float:
    return (10e9 + 2.5e9 * (round(t) % 5)) / CAPACITY


def creep(t: float) -> float:
    return 0.90 * t / 10 if t < 10 else 0.95 - 0.05 * math.exp(-(t - 10) / 60)


def warm95(t: float) -> float:
    return 0.95 * t / 10 if t < 10 else 0.95 + (t - 10) * MIB / CAPACITY


def saw60(t: float) -> float:
    return 0.30 + 0.40 * (t % 60) / 60


def plateau(t: float) -> float:
    return 0.90 + _PLATEAU(t)


def surge(t: float) -> float:
    if t < 60 or t >= 90:
        return 0.40
    if t < 65:
        return 0.40 + 0.40 * (t - 60) / 5
    return 0.80 if t < 85 else 0.80 - 0.40 * (t - 85) / 5


def _cycle(t: float, period: float, low: float, high: float, up: float, hold: float) -> float:
    """``low → high`` over ``up`` minutes, held ``hold``, freed back to ``low`` by the period's end."""
    phase = t % period
    if phase < up:
        return low + (high - low) * phase / up
    if phase < up + hold:
        return high
    return high - (high - low) * (phase - up - hold) / (period - up - hold)


def cycles15(t: float) -> float:
    # Shifted 3 minutes so that the 5-minute checks fall on each climb's last minutes.
    return _cycle(t + 3, 15, 0.20, 0.88, 14, 0)


def cycles60(t: float) -> float:
    return _cycle(t, 60, 0.30, 0.88, 25, 25)


def cache95(t: float) -> float:
    return _cycle(t, 15, 0.40, 0.95, 10, 2)


def restart(t: float) -> float | None:
    if 120 <= t < 121.5:
        return None  # killed: two scrapes fail
    return warmup(t - 121.5 if t >= 120 else t)


def redeploy(t: float) -> float | None:
    if t < 120:
        return 0.40
    if t < 121:
        return None
    return (2e9 + (0.88 * CAPACITY - 2e9) * min(t - 121, 15) / 15) / CAPACITY


def reload(t: float) -> float | None:
    if t < 120:
        return 0.40
    if t < 120.5:
        return None  # one scrape fails; the new process has loaded its 40% by the next
    return 0.40 + 0.30 * min(t - 120.5, 15) / 15


#: Shape → the minute its process (re)started last, by minute (the start time the scrape shows).
RESTARTS: dict[str, float] = {"restart": 121.5, "redeploy": 121, "reload": 120.5}
#: process_start_time_seconds of a shape's first process.
BOOT = 1_700_000_000


def start_time(name: str, t: float) -> float:
    restarted = RESTARTS.get(name)
    return BOOT + (restarted * 60 if restarted is not None and t >= restarted else 0)


# --- cases ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Firing:
    """An alert expected at one time; ``description`` per profile (values move with compression)."""

    alertname: str
    labels: dict[str, str]
    description: dict[str, str]
    #: GPUMemoryRunningOut's two rules: "sustained" or "near_full".
    trigger: str = ""


@dataclass(frozen=True)
class Check:
    minute: float
    alertname: str
    firing: tuple[Firing, ...] = ()


@dataclass
class Case:
    name: str
    comment: str
    minutes: int
    step_s: int
    server: dict[str, Callable[[float], float]]
    gpus: dict[str, Callable[[float], float]] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)


ALERTS = ("GPUMemoryLeak", "GPUMemoryRunningOut", "GPUFramebufferFillingUp", "GPUFramebufferRunningOut")
HEALTHY = {"warmup": warmup, "sawtooth": sawtooth, "creep": creep, "warm95": warm95, "saw60": saw60,
           "plateau": plateau, "surge": surge, "cycles15": cycles15, "cycles60": cycles60, "cache95": cache95,
           "restart": restart, "redeploy": redeploy}
HEALTHY_SERVER_ONLY = {"reload": reload}


def _server(instance: str, alertname: str, description: dict[str, str], trigger: str = "") -> Firing:
    labels = {"job": "gpuscope-server", "instance": instance, "device": "cuda:0"}
    return Firing(alertname, labels, description, trigger)


def _gpu(gpu: str, alertname: str, description: dict[str, str], trigger: str = "") -> Firing:
    labels = {"job": "gpuscope-exporter", "instance": GPU_HOST, "gpu": gpu}
    return Firing(alertname, labels, description, trigger)


def _both(text: str) -> dict[str, str]:
    return {"production": text, "test": text}


def _slow(where: str, now: str, rate: str, left: str) -> str:
    return (f"{where} holds {now} of 80GiB. Its floor (lowest value over {{floor}}) grew in every {{step}} "
            f"of the last {{span}}, in the last {{rate_span}} by at least {rate}/s; at that rate the memory "
            f"runs out in {left}.")


def _fast(where: str, now: str, rate: str, left: str) -> str:
    return (f"{where} holds {now} of 80GiB, above every peak of the {{history}} before, and grew {rate}/s "
            f"over the last {{fast_step}}; at that rate the memory runs out in {left}.")


def _near_full(where: str, now: str, left: str) -> str:
    return (f"{where} holds {now} of 80GiB (at least 90%, above every earlier peak) and is still climbing: "
            f"at its growth since the last evaluation the memory runs out in {left}.")


def _climbing(where: str, now: str, left: str) -> str:
    return (f"{where} holds {now} of 80GiB, above every earlier peak, and its floor grew in every "
            f"{{climb_step}} of the last {{climb}} at the pace of a leak, not of a load: at its slowest "
            f"growth the memory runs out in {left}.")


def cases() -> list[Case]:
    healthy = Case(
        "healthy", "Healthy shapes, on the server and on GPU framebuffers: silent at every check.",
        minutes=360, step_s=30, server={**HEALTHY, **HEALTHY_SERVER_ONLY},
        gpus={str(i): fn for i, fn in enumerate(HEALTHY.values())},
        checks=[Check(minute, name) for minute in range(0, 361, 5) for name in ALERTS])
    s = "The server {i}:8000 on cuda:0"
    return [
        healthy,
        Case("leak", "leak: 40 GiB + 15 GiB/h from the first sample; runs out at 160m. GPU 0 the same, "
                     "GPU 1 flat.\nFires after its 95m of history + 10m; pages once 30m are left.",
             minutes=160, step_s=60, server={"leak": leak}, gpus={"0": leak, "1": lambda t: 0.5},
             checks=[
                 Check(100, "GPUMemoryLeak"), Check(100, "GPUFramebufferFillingUp"),
                 Check(110, "GPUMemoryLeak", (_server("leak:8000", "GPUMemoryLeak", {
                     "production": _slow(s.format(i="leak"), "67.5GiB", "4.267MiB", "50m 0s"),
                     "test": _slow(s.format(i="leak"), "67.5GiB", "64MiB", "3m 20s")}),)),
                 Check(110, "GPUFramebufferFillingUp", (_gpu("0", "GPUFramebufferFillingUp", {
                     "production": _slow("GPU 0 on gpu-host:9400", "67.5GiB", "4.267MiB", "50m 0s"),
                     "test": _slow("GPU 0 on gpu-host:9400", "67.5GiB", "64MiB", "3m 20s")}),)),
                 Check(110, "GPUMemoryRunningOut"),
                 Check(150, "GPUMemoryRunningOut", (_server("leak:8000", "GPUMemoryRunningOut", {
                     "production": _fast(s.format(i="leak"), "77.5GiB", "4.267MiB", "10m 0s"),
                     "test": _fast(s.format(i="leak"), "77.5GiB", "76.8MiB", "33.33s")}, "sustained"),)),
             ]),
        Case("steps", "steps: 70%, then +1% of capacity every 10 minutes from 60m; runs out at 360m.\n"
                      "The floor grows 2% in every 20m: fires ~85m after the leak starts.",
             minutes=360, step_s=60, server={"steps": steps},
             checks=[
                 Check(140, "GPUMemoryLeak"),
                 Check(160, "GPUMemoryLeak", (_server("steps:8000", "GPUMemoryLeak", {
                     "production": _slow(s.format(i="steps"), "64.8GiB", "1.365MiB", "3h 10m 0s"),
                     "test": _slow(s.format(i="steps"), "64.8GiB", "20.48MiB", "12m 40s")}),)),
                 Check(160, "GPUMemoryRunningOut"),
             ]),
        Case("cycles", "cycles: 10-minute allocate/free cycles (+25% in 3m, held 5m, freed in 2m) whose\n"
                       "floor rises 1.5% a cycle from 60m; their peaks reach capacity at ~233m.",
             minutes=240, step_s=60, server={"cycles": cycles},
             checks=[
                 Check(140, "GPUMemoryLeak"),
                 Check(150, "GPUMemoryLeak", (_server("cycles:8000", "GPUMemoryLeak", {
                     "production": _slow(s.format(i="cycles"), "50.8GiB", "2.048MiB", "1h 26m 40s"),
                     "test": _slow(s.format(i="cycles"), "50.8GiB", "30.72MiB", "5m 46s")}),)),
                 Check(150, "GPUMemoryRunningOut"),
             ]),
        Case("noisy", "noisy: 50%, then +10%/h from 60m, with ±1% allocation noise on 30-second scrapes;\n"
                      "runs out at 360m. The floor's slowest interval reads the rate low: fires later.",
             minutes=360, step_s=30, server={"noisy": noisy},
             checks=[
                 Check(130, "GPUMemoryLeak"),
                 Check(180, "GPUMemoryLeak", (_server("noisy:8000", "GPUMemoryLeak", {
                     "production": _slow(s.format(i="noisy"), "55.66GiB", "1.894MiB", "3h 29m 48s"),
                     "test": _slow(s.format(i="noisy"), "55.66GiB", "28.4MiB", "13m 59s")}),)),
                 Check(180, "GPUMemoryRunningOut"),
             ]),
        Case("fast", "fast: 40%, then +3% a minute from 60m; runs out at 80m. GPU 0 the same.\n"
                     "GPUMemoryLeak cannot see it in time; GPUMemoryRunningOut pages ~7m before the end\n"
                     "(sustained, and climbing after its 12m climb).",
             minutes=80, step_s=30, server={"fast": fast}, gpus={"0": fast},
             checks=[
                 Check(72, "GPUMemoryRunningOut"), Check(72, "GPUFramebufferRunningOut"),
                 Check(75, "GPUMemoryRunningOut", (_server("fast:8000", "GPUMemoryRunningOut", {
                     "production": _fast(s.format(i="fast"), "68GiB", "40.96MiB", "5m 0s"),
                     "test": _fast(s.format(i="fast"), "68GiB", "614.4MiB", "20s")}, "sustained"),
                     _server("fast:8000", "GPUMemoryRunningOut", {
                     "production": _climbing(s.format(i="fast"), "68GiB", "5m 0s"),
                     "test": _climbing(s.format(i="fast"), "68GiB", "20s")}, "climbing"))),
                 Check(75, "GPUFramebufferRunningOut", (_gpu("0", "GPUFramebufferRunningOut", {
                     "production": _fast("GPU 0 on gpu-host:9400", "68GiB", "40.96MiB", "5m 0s"),
                     "test": _fast("GPU 0 on gpu-host:9400", "68GiB", "614.4MiB", "20s")}, "sustained"),
                     _gpu("0", "GPUFramebufferRunningOut", {
                     "production": _climbing("GPU 0 on gpu-host:9400", "68GiB", "5m 0s"),
                     "test": _climbing("GPU 0 on gpu-host:9400", "68GiB", "20s")}, "climbing"))),
                 Check(75, "GPUMemoryLeak"),
             ]),
        Case("early", "early: a leak from the process's first minute, 0 -> 100% in 30m; GPU 0 the same.\n"
                      "Younger than the warm-up guard: the climbing rule pages once its 12m climb runs out\n"
                      "within 10m; the near-full rule joins at 90% (27m), still climbing, a minute later.",
             minutes=30, step_s=30, server={"early": early}, gpus={"0": early},
             checks=[
                 Check(19, "GPUMemoryRunningOut"), Check(19, "GPUFramebufferRunningOut"),
                 Check(24, "GPUMemoryRunningOut", (_server("early:8000", "GPUMemoryRunningOut", {
                     "production": _climbing(s.format(i="early"), "64GiB", "6m 0s"),
                     "test": _climbing(s.format(i="early"), "62.67GiB", "26s")}, "climbing"),)),
                 Check(24, "GPUFramebufferRunningOut", (_gpu("0", "GPUFramebufferRunningOut", {
                     "production": _climbing("GPU 0 on gpu-host:9400", "64GiB", "6m 0s"),
                     "test": _climbing("GPU 0 on gpu-host:9400", "62.67GiB", "26s")}, "climbing"),)),
                 Check(29.5, "GPUMemoryRunningOut", (_server("early:8000", "GPUMemoryRunningOut", {
                     "production": _climbing(s.format(i="early"), "78.67GiB", "30s"),
                     "test": _climbing(s.format(i="early"), "76GiB", "6s")}, "climbing"),
                     _server("early:8000", "GPUMemoryRunningOut", {
                     "production": _near_full(s.format(i="early"), "78.67GiB", "30s"),
                     "test": _near_full(s.format(i="early"), "76GiB", "7.5s")}, "near_full"))),
                 Check(29.5, "GPUFramebufferRunningOut", (_gpu("0", "GPUFramebufferRunningOut", {
                     "production": _climbing("GPU 0 on gpu-host:9400", "78.67GiB", "30s"),
                     "test": _climbing("GPU 0 on gpu-host:9400", "76GiB", "6s")}, "climbing"),
                     _gpu("0", "GPUFramebufferRunningOut", {
                     "production": _near_full("GPU 0 on gpu-host:9400", "78.67GiB", "30s"),
                     "test": _near_full("GPU 0 on gpu-host:9400", "76GiB", "7.5s")}, "near_full"))),
             ]),
        Case("young", "young: a process that starts at 40% and grows 3% of capacity a minute; runs out at\n"
                      "20m. GPU 0 the same. The climbing rule pages with at least 5 minutes left (15m).",
             minutes=20, step_s=30, server={"young": young}, gpus={"0": young},
             checks=[
                 Check(11, "GPUMemoryRunningOut"), Check(11, "GPUFramebufferRunningOut"),
                 Check(15, "GPUMemoryRunningOut", (_server("young:8000", "GPUMemoryRunningOut", {
                     "production": _climbing(s.format(i="young"), "68GiB", "5m 0s"),
                     "test": _climbing(s.format(i="young"), "68GiB", "20s")}, "climbing"),)),
                 Check(15, "GPUFramebufferRunningOut", (_gpu("0", "GPUFramebufferRunningOut", {
                     "production": _climbing("GPU 0 on gpu-host:9400", "68GiB", "5m 0s"),
                     "test": _climbing("GPU 0 on gpu-host:9400", "68GiB", "20s")}, "climbing"),)),
                 Check(15, "GPUMemoryLeak"), Check(15, "GPUFramebufferFillingUp"),
             ]),
    ]


# --- rendering -----------------------------------------------------------------------------------------

def _seconds(minutes: float, p: Profile) -> str:
    return f"{minutes * 60 / p.compression:g}s"


def _values(fn: Callable[[float], float | None], case: Case) -> str:
    """promtool's values; a shape's None is a failed scrape: a staleness marker, then nothing."""
    out: list[str] = []
    for i in range(case.minutes * 60 // case.step_s + 1):
        value = fn(i * case.step_s / 60)
        if value is None:
            out.append("stale" if out and out[-1] not in ("stale", "_") else "_")
        else:
            out.append(str(round(max(0.0, min(value, 1.0)) * CAPACITY)))
    return " ".join(out)


def _start_times(name: str, fn: Callable[[float], float | None], case: Case) -> str:
    """The process's start time where its memory was scraped (a failed scrape misses both)."""
    out: list[str] = []
    for i in range(case.minutes * 60 // case.step_s + 1):
        t = i * case.step_s / 60
        if fn(t) is None:
            out.append("stale" if out and out[-1] not in ("stale", "_") else "_")
        else:
            out.append(f"{start_time(name, t):.0f}")
    return " ".join(out)


def _windows(p: Profile) -> dict[str, str]:
    from gpuscope.alerting.rules import duration
    from gpuscope.contract.profiles import PROFILES as ALERT_PROFILES

    w = ALERT_PROFILES[p.name].windows
    span = w.leak - w.leak_floor
    return {"floor": duration(w.leak_floor), "step": duration(w.leak_step), "span": duration(span),
            "rate_span": duration(span - w.leak_step), "fast_step": duration(w.leak_fast_step),
            "history": duration(w.leak_fast_history), "climb": duration(w.leak_climb),
            "climb_step": duration(w.leak_climb_step)}


def _annotations(f: Firing, p: Profile) -> list[str]:
    server = f.labels["job"] == "gpuscope-server"
    alert = {"GPUMemoryLeak": "Memory of {i} ({d}) leaks towards exhaustion",
             "GPUMemoryRunningOut": "Memory of {i} ({d}) runs out within {h}",
             "GPUFramebufferFillingUp": "GPU {g} on {i} fills its memory",
             "GPUFramebufferRunningOut": "GPU {g} on {i} runs out of memory within {h}"}[f.alertname]
    from gpuscope.alerting.rules import duration
    from gpuscope.contract.profiles import PROFILES as ALERT_PROFILES

    w = ALERT_PROFILES[p.name].windows
    horizon = duration({"near_full": w.leak_near_full_horizon, "climbing": w.leak_climb_horizon}
                       .get(f.trigger, w.leak_fast_horizon))
    summary = alert.format(i=f.labels["instance"], d=f.labels.get("device"), g=f.labels.get("gpu"), h=horizon)
    url = f"{GRAFANA}?var-instance={f.labels['instance']}" + ("" if server else f"&var-gpu={f.labels['gpu']}")
    description = f.description[p.name].format(**_windows(p))
    return [f"summary: '{summary}'", f"description: '{description}'",
            f"runbook_url: {RUNBOOK}#{f.alertname.lower()}", f"dashboard_url: {url}"]


def _group_order(p: Profile) -> list[str]:
    from gpuscope.alerting.generate import group_order
    from gpuscope.contract.profiles import PROFILES as ALERT_PROFILES

    return ["group_eval_order:", *(f"  - {name}" for name in group_order(ALERT_PROFILES[p.name]))]


def render(p: Profile) -> str:
    out = [f"# Generated by `python -m tests.alerts.memory_shapes` ({p.name} profile); do not edit. The",
           "# shapes, their bounds and why each is there: tests/alerts/memory_shapes.py. Capacity 80 GiB.",
           "rule_files:", f"  - {p.rules}/sources.rules.yml", f"  - {p.rules}/gpuscope.rules.yml",
           *_group_order(p), f"evaluation_interval: {p.evaluation_interval_s}s", "tests:"]
    for case in cases():
        out += [f"  # {line}" for line in case.comment.splitlines()]
        out += [f"  - name: {case.name}", f"    interval: {case.step_s / p.compression:g}s",
                "    input_series:"]
        for instance, fn in case.server.items():
            labels = f'{SERVER},instance="{instance}:8000",device="cuda:0"'
            out += [f"      - series: 'gpuscope_device_memory_allocated_bytes{{{labels}}}'",
                    f"        values: '{_values(fn, case)}'",
                    f"      - series: 'process_start_time_seconds{{{SERVER},instance=\"{instance}:8000\"}}'",
                    f"        values: '{_start_times(instance, fn, case)}'",
                    f"      - series: 'gpuscope_device_memory_total_bytes{{{labels}}}'",
                    f"        values: '{CAPACITY}+0x{case.minutes * 60 // case.step_s}'"]
        for gpu, fn in case.gpus.items():
            labels = f'{EXPORTER},instance="{GPU_HOST}",gpu="{gpu}"'
            out += [f"      - series: 'gpuscope_gpu_memory_used_bytes{{{labels}}}'",
                    f"        values: '{_values(fn, case)}'",
                    f"      - series: 'gpuscope_gpu_memory_total_bytes{{{labels}}}'",
                    f"        values: '{CAPACITY}+0x{case.minutes * 60 // case.step_s}'"]
        out.append("    alert_rule_test:")
        for check in case.checks:
            out += [f"      - eval_time: {_seconds(check.minute, p)}",
                    f"        alertname: {check.alertname}"]
            if not check.firing:
                out.append("        exp_alerts: []")
                continue
            out.append("        exp_alerts:")
            for f in check.firing:
                severity = "critical" if f.alertname.endswith("RunningOut") else "warning"
                service = "gpuscope-server" if f.labels["job"] == "gpuscope-server" else "gpuscope-exporter"
                out += ["          - exp_labels:", f"              severity: {severity}",
                        f"              service: {service}"]
                out += [f"              {k}: {v}" for k, v in f.labels.items()]
                if f.trigger:
                    out.append(f"              trigger: {f.trigger}")
                out.append("            exp_annotations:")
                out += [f"              {line}" for line in _annotations(f, p)]
    return "\n".join(out) + "\n"


def outputs() -> dict[str, str]:
    return {p.path: render(p) for p in PROFILES}


def main() -> int:
    return case_files.write(outputs())


if __name__ == "__main__":
    raise SystemExit(main())
