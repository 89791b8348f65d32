"""Work-conserving turns on the fake driver's shared GPU (FAKE_CUDA_REALTIME, FAKE_CUDA_SHARED_GPU):
a training-like tenant, whose steps wait for the GPU and then do host work, beside a GPU-bound one.

Exclusive turns left the GPU idle through the holder's host work and handed the turn away at each
gap, so such a tenant got a fraction of its share. Now a holder on the host lends the rest of its
turn and takes it back at its next launch, and it is charged the GPU time its kernels took."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.metrics import ShareCollector
from gpuscope.share.settings import Handover, Turns
from tests.conftest import wait_for
from tests.share.fakecuda import HERE, child_env, running_controller

SECONDS = 3.0
#: Training-like steps: (kernels a step, each kernel's µs, host work in ms). One keeps the GPU busy
#: about two thirds of its time (it takes turns, and lends them while on the host), the other about a
#: quarter (its probes let it run beside the hog, which fills its gaps).
KERNEL_HEAVY, HOST_HEAVY = (13, 300, 2), (5, 300, 4)


def run(fake, tmp_path, kinds: list[str], tenants: list[str] | None = None,
        ledger: str | None = None, shape: tuple[int, int, int] = KERNEL_HEAVY) -> list[int]:
    """Each kind as a process on one fake GPU for SECONDS; the steps each finished."""
    gpu = tmp_path / f"gpu-{'-'.join(kinds)}-{'managed' if tenants else 'plain'}"
    burst, kernel_us, gap_ms = shape
    procs = []
    for i, kind in enumerate(kinds):
        env = child_env(fake, os.devnull, tenant=tenants[i] if tenants else None, ledger=ledger)
        env.update(FAKE_CUDA_REALTIME="1", FAKE_CUDA_SHARED_GPU=str(gpu), WORKLOAD_BURST=str(burst),
                   WORKLOAD_KERNEL_US=str(kernel_us), WORKLOAD_GAP_MS=str(gap_ms))
        argv = [sys.executable, str(HERE / "workload.py"), kind, str(SECONDS)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    steps = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        steps.append(json.loads(out)["steps"])
    return steps


@pytest.fixture(scope="module")
def alone(fake_cuda, tmp_path_factory) -> dict[tuple, int]:
    """Each workload's steps alone on the fake GPU (the library loaded, no controller)."""
    return {(kind, shape): run(fake_cuda, tmp_path_factory.mktemp("alone"), [kind], shape=shape)[0]
            for kind, shape in (("steps", KERNEL_HEAVY), ("steps", HOST_HEAVY), ("busy", KERNEL_HEAVY))}


@pytest.mark.parametrize("handover, turns", [(Handover.DRAIN, Turns.C), (Handover.DRAIN, Turns.PYTHON),
                                             (Handover.OVERLAP, Turns.C)],
                         ids=["drain", "drain-python", "overlap"])
def test_a_tenant_with_host_gaps_gets_its_share_beside_a_gpu_bound_one(fake_cuda, tmp_path, alone, handover,
                                                                        turns):
    ledger = str(tmp_path / "ledger")
    with running_controller(ledger, [TenantPolicy("train", 0.7), TenantPolicy("hog", 0.3)], slice=0.03,
                            handover=handover, turns=turns, drain_timeout=2.0) as c:
        steps, kernels = run(fake_cuda, tmp_path, ["steps", "busy"], ["train", "hog"], ledger)
        shown = {m.name: m.samples[0].value for m in ShareCollector(c).collect() if "turns" in m.name}
    train, hog = steps / alone[("steps", KERNEL_HEAVY)], kernels / alone[("busy", KERNEL_HEAVY)]
    # alone the training tenant keeps the GPU busy about two thirds of the time: at 0.7 it needs
    # about half of it, and the hog has the rest (exclusive turns gave it 0.3 of its steps and idled
    # the GPU). Busy more than half the time, it takes turns rather than running beside the hog
    assert 0 not in c.beside, c.prober.busy_ratio
    assert train >= 0.6, (train, hog, c.stats)
    assert hog >= 0.22, (train, hog, c.stats)
    assert c.stats.lends > 0 and c.stats.reclaims > 0
    assert 0 < shown["gpuscope_share_lent_turns"] <= c.stats.lends  # /metrics shows them
    assert 0 < shown["gpuscope_share_reclaimed_turns"] <= c.stats.reclaims
    if handover == Handover.DRAIN:  # exact charges (overlapping hand-overs split concurrent time evenly)
        # charged its kernels' time, not the host work between them. A step is 3 ms of kernels and
        # 3 ms on the host, so charging the host work too reads about twice the kernels' time; the
        # bounds sit between the two, with room for a busy machine descheduling the fake GPU's
        # tenants inside a window (that time reads as GPU time, as on a real host it would not)
        burst, kernel_us, _ = KERNEL_HEAVY
        gpu_s = steps * burst * kernel_us / 1e6
        assert 0.7 * gpu_s <= c.stats.charged_s["train"] <= 1.55 * gpu_s, (c.stats.charged_s, gpu_s)


def test_a_tenant_that_leaves_the_gpu_idle_runs_beside_the_hog(fake_cuda, tmp_path, alone):
    """Busy a quarter of its time, the training tenant runs beside the hog instead of taking turns: the
    GPU fills its host work with the hog's kernels and nobody lends or reclaims a turn. Of higher
    priority, it has the hog holding the GPU keep a short queue (``--share.beside-queue``, 500 µs by
    default), so its bursts wait little behind the hog: the fake GPU runs the processes' kernels one
    after another (with the hog's usual queue of two 2 ms windows it fell under its share there)."""
    ledger = str(tmp_path / "ledger")
    with running_controller(ledger, [TenantPolicy("train", 0.7, priority=1), TenantPolicy("hog", 0.3)],
                            slice=0.03, drain_timeout=2.0) as c:
        steps, kernels = run(fake_cuda, tmp_path, ["steps", "busy"], ["train", "hog"], ledger, HOST_HEAVY)
        busy = dict(c.prober.busy_ratio)
        wait_for(lambda: "hog" in c.stats.departed, what="the hog's counters")
        hog_counters = c.stats.departed["hog"]
    train, hog = steps / alone[("steps", HOST_HEAVY)], kernels / alone[("busy", KERNEL_HEAVY)]
    # its probes found it busy under half the time and the hog busy most of it
    assert busy[0] <= 0.5 * 1.25 and busy[1] > 0.5, busy
    assert c.stats.probes >= 2
    # beside the hog it keeps most of its alone rate (its share, give or take a busy machine), and the
    # hog uses the gaps
    assert train >= 0.65, (train, hog, busy, c.stats)
    assert hog >= 0.45, (train, hog, busy, c.stats)
    # the hog's windows were short while the training tenant ran beside it: its 300 µs kernels came
    # about one a window (about four with the usual 2 ms windows)
    assert hog_counters["launches"] <= 2.5 * hog_counters["windows"], hog_counters


@pytest.mark.parametrize(("priority", "beside_queue"), [(0, None), (1, 0.0), (1, 0.004)],
                         ids=["equal-priority", "queue-0", "as-long-as-usual"])
def test_the_holder_keeps_its_usual_queue_unless_a_latency_tenant_is_beside(fake_cuda, tmp_path, priority,
                                                                           beside_queue):
    """Beside a tenant of its own priority (the default 500 µs applies only to a tenant of higher
    priority), or with ``--share.beside-queue`` at 0 or as long as the usual queue (two 2 ms windows):
    no short queue, the hog holding the GPU beside the training tenant keeps windows of its usual length."""
    ledger = str(tmp_path / "ledger")
    queue = {} if beside_queue is None else {"beside_queue": beside_queue}
    with running_controller(ledger, [TenantPolicy("train", 0.7, priority=priority), TenantPolicy("hog", 0.3)],
                            slice=0.03, drain_timeout=2.0, **queue) as c:
        run(fake_cuda, tmp_path, ["steps", "busy"], ["train", "hog"], ledger, HOST_HEAVY)
        wait_for(lambda: "hog" in c.stats.departed, what="the hog's counters")
        hog_counters = c.stats.departed["hog"]
        busy = dict(c.prober.busy_ratio)
    assert busy[0] <= 0.5 * 1.25 and busy[1] > 0.5, busy  # the training tenant ran beside the hog
    # about six 300 µs kernels a 2 ms window (one with the short queue)
    assert hog_counters["launches"] >= 3.5 * hog_counters["windows"], hog_counters
