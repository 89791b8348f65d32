"""XID events: counted per code, last-seen stamped, prompt shutdown, unsupported platforms tolerated."""

from __future__ import annotations

import time

import pynvml

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.config import Config
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.xid import WELL_KNOWN_XIDS
from tests.conftest import wait_for
from tests.nvml.conftest import value


def _xids(ex: Exporter, gpu: str, xid: int) -> float | None:
    return value(ex, cat.GPU_XID_ERRORS.name, gpu=gpu, xid=str(xid))


def test_each_xid_event_is_counted_and_stamped(start_exporter, fake) -> None:
    ex = start_exporter(fake)
    wait_for(lambda: _xids(ex, "0", 79) == 0, what="well-known XIDs exported at 0")
    wait_for(lambda: fake.event_sets and len(fake.event_sets[0].devices) == 2, what="registration")
    before = time.time()
    fake.inject_xid(0, 79)
    fake.inject_xid(0, 79)  # a repeat must show (dcgm-exporter's last-value gauge cannot)
    fake.inject_xid(1, 31)
    fake.inject_xid(1, 1234)  # an unlisted code gets its own series
    wait_for(lambda: _xids(ex, "0", 79) == 2 and _xids(ex, "1", 1234) == 1, what="events counted")
    assert _xids(ex, "1", 31) == 1
    assert _xids(ex, "1", 79) == 0
    stamp = value(ex, cat.GPU_XID_LAST.name, gpu="0", xid="79")
    assert before <= stamp <= time.time()
    assert value(ex, cat.GPU_XID_LAST.name, gpu="0", xid="31") is None
    assert len(WELL_KNOWN_XIDS) == len({x for x in WELL_KNOWN_XIDS})


def test_unsupported_event_registration_is_counted_and_the_rest_continues(start_exporter, fake) -> None:
    fake.register_error = pynvml.NVML_ERROR_NOT_SUPPORTED
    ex = start_exporter(fake)
    wait_for(lambda: value(ex, cat.EXPORTER_ERRORS.name, call="nvmlDeviceRegisterEvents") == 2)
    wait_for(lambda: fake.event_sets[0].freed, what="event set freed")
    assert _xids(ex, "0", 79) is None  # zeros would claim "no XIDs" where none can be seen
    assert value(ex, cat.EXPORTER_STALENESS.name, collector="xid") is None
    fake.gpus[0].temp_c = 66
    wait_for(lambda: value(ex, cat.GPU_TEMPERATURE.name, gpu="0") == 66)


def test_failing_waits_are_counted_and_backed_off(start_exporter, fake) -> None:
    fake.wait_error = pynvml.NVML_ERROR_UNKNOWN
    ex = start_exporter(fake)
    wait_for(lambda: (value(ex, cat.EXPORTER_ERRORS.name, call="nvmlEventSetWait") or 0) >= 1)
    fake.wait_error = None
    wait_for(lambda: _xids(ex, "0", 79) == 0, timeout=15, what="recovery after back-off")
    fake.inject_xid(0, 48)
    wait_for(lambda: _xids(ex, "0", 48) == 1)


def test_xid_thread_stops_promptly(fake) -> None:
    ex = Exporter(Config(interval=0.05, slow_interval=0.1), nv=fake, xid_wait_ms=200).start()
    wait_for(lambda: fake.event_sets and len(fake.event_sets[0].devices) == 2)
    started = time.monotonic()
    ex.stop(timeout=2.0)
    assert ex.xid is not None and not ex.xid._thread.is_alive()
    assert time.monotonic() - started < 1.0
    assert fake.event_sets[0].freed
