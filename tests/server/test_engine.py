"""The engine with the real model, scheduler and timer: batching, joining, GPU-time shares."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from gpuscope.server.config import ModelSpec, parse_tenants
from gpuscope.server.engine import Done, Engine, Failed, Request
from gpuscope.server.metrics import RequestMetrics
from gpuscope.server.model import build_model, encode
from gpuscope.server.scheduler import Scheduler
from gpuscope.server.step_timing import build_timer
from tests.conftest import wait_for

SPEC = ModelSpec(layers=1, dim=64, heads=4, context=256)


class Rig:
    def __init__(self, tenants="a:0.7,b:0.3", batch=4, max_wait=0.05, timing="all"):
        self.registry = CollectorRegistry()
        self.timer = build_timer(timing, self.registry)
        self.scheduler = Scheduler(parse_tenants(tenants), "share", 1000)
        self.metrics = RequestMetrics(self.registry, [t.name for t in parse_tenants(tenants)])
        self.done: list[Request] = []
        self.lock = threading.Lock()
        self.refill: set[str] = set()
        self._pause_if: Callable[[], bool] | None = None
        self.paused = threading.Event()
        self._resume = threading.Event()
        self.engine = Engine(build_model(SPEC), self.scheduler, self.timer, batch_size=batch,
                             max_wait_s=max_wait, deliver=self.deliver, metrics=self.metrics,
                             log_requests=False)
        self.engine.start()
        assert self.engine.ready.wait(30)

    def deliver(self, events):
        for req, event in events:
            if isinstance(event, Done | Failed):
                with self.lock:
                    self.done.append(req)
                if req.tenant in self.refill:
                    self.engine.submit(Request(req.tenant, encode("refill"), 8, 0.0))
        if self._pause_if is not None and self._pause_if():
            self._pause_if = None
            self.paused.set()
            self._resume.wait(60)

    def pause_after(self, condition: Callable[[], bool]) -> None:
        """Hold the engine thread after the first step that makes ``condition()`` true, until resume().

        ``deliver`` runs on the engine thread between steps: while it waits, no request moves, so
        what a test does then happens between two decode steps, however slow the machine.
        """
        self.paused.clear()
        self._resume.clear()
        self._pause_if = condition

    def resume(self) -> None:
        self._resume.set()

    def submit(self, tenant="a", tokens=8, prompt="hi"):
        req = self.request(tenant, tokens, prompt)
        self.engine.submit(req)
        return req

    @staticmethod
    def request(tenant="a", tokens=8, prompt="hi"):
        return Request(tenant, encode(prompt), tokens, 0.0, trace_id="t")

    def close(self):
        self.refill.clear()
        self._pause_if = None
        self._resume.set()
        self.engine.stop()
        self.timer.close()

    def batch_hist(self, phase, le):
        return self.registry.get_sample_value("gpuscope_batch_size_bucket", {"phase": phase, "le": le})


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_concurrent_requests_share_batches():
    # A window far longer than submitting takes, however slow the machine: a full batch closes it.
    rig = Rig(max_wait=600.0)
    try:
        reqs = [rig.submit() for _ in range(4)]
        wait_for(lambda: all(r.outcome for r in reqs), what="4 requests done")
        # The max-wait window gathered them into one prefill of 4, then decoded them together.
        assert rig.batch_hist("prefill", "2.0") == 0 and rig.batch_hist("prefill", "4.0") == 1
        assert rig.batch_hist("decode", "2.0") == 0
    finally:
        rig.close()


def test_batching_off_runs_one_request_at_a_time():
    rig = Rig(batch=1, max_wait=0.0)
    try:
        reqs = [rig.submit() for _ in range(3)]
        wait_for(lambda: all(r.outcome for r in reqs), what="3 requests done")
        count = rig.registry.get_sample_value("gpuscope_batch_size_count", {"phase": "decode"})
        assert rig.batch_hist("decode", "1.0") == count > 0
        assert reqs[0].finished_at <= reqs[1].scheduled_at  # strictly one after another
    finally:
        rig.close()


def test_new_requests_join_between_decode_steps(rig):
    long = rig.request(tokens=200)
    rig.pause_after(lambda: len(long.generated) >= 5)
    rig.engine.submit(long)
    assert rig.paused.wait(30), "long request never decoding"
    short = rig.submit(tokens=3)  # arrives between two of long's decode steps
    rig.resume()
    wait_for(lambda: short.outcome is not None, what="short request done")
    assert long.outcome is None  # it joined the running batch instead of waiting for it to drain
    wait_for(lambda: long.outcome == "length", timeout=30)


def test_cancelled_request_leaves_the_batch(rig):
    req = rig.request(tokens=200)
    rig.pause_after(lambda: len(req.generated) >= 2)
    rig.engine.submit(req)
    assert rig.paused.wait(30), "never decoding"
    generated = len(req.generated)
    rig.engine.cancel(req)  # between two decode steps
    rig.resume()
    wait_for(lambda: req.outcome == "abort", what="abort")
    assert len(req.generated) == generated < 200  # it left at the next step
    assert rig.registry.get_sample_value("gpuscope_requests_total", {"tenant": "a", "outcome": "abort"}) == 1


def test_measured_gpu_time_follows_70_30_shares(rig):
    rig.refill = {"a", "b"}
    for _ in range(8):
        rig.submit("a")
        rig.submit("b")
    wait_for(lambda: len(rig.done) >= 40, timeout=30, what="warm-up")
    rig.timer.flush(5)
    before = rig.scheduler.gpu_seconds()
    deadline = time.monotonic() + 3.0
    wait_for(lambda: time.monotonic() > deadline, timeout=10)  # a 3 s measurement window
    rig.timer.flush(5)
    after = rig.scheduler.gpu_seconds()
    used = {t: after[t] - before[t] for t in after}
    share_a = used["a"] / sum(used.values())
    assert share_a == pytest.approx(0.7, abs=0.02), used
    # The same figures are what /metrics reports per tenant.
    assert rig.scheduler.state()["a"].gpu_seconds == pytest.approx(after["a"], rel=0.05)


def test_prefill_and_decode_regions_are_timed(rig):
    reqs = [rig.submit(tokens=4) for _ in range(2)]
    wait_for(lambda: all(r.outcome for r in reqs))
    rig.timer.flush(5)
    for op in ("prefill", "decode"):
        assert rig.registry.get_sample_value("gpuscope_region_gpu_seconds_count",
                                             {"op": op, "device": "cpu"}) > 0
