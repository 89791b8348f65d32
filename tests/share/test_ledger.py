"""The ledger's shared words read and written the same way through the C extension and through ctypes."""

from __future__ import annotations

import threading
import time

import pytest

from gpuscope.share import ledger
from gpuscope.share.ledger import P_GATE, P_HEARTBEAT, Policy, TenantPolicy

ROUTES = ["ctypes"] + (["c"] if ledger._native_words is not None else [])


@pytest.fixture(params=ROUTES)
def policy(request, tmp_path, monkeypatch):
    if request.param == "ctypes":
        monkeypatch.setattr(ledger, "_words", ledger.CtypesWords)
    p = Policy(str(tmp_path / "ledger"), [TenantPolicy("a", 0.5), TenantPolicy("b", 0.5)])
    yield p
    p.close()


def test_words_round_trip(policy):
    m = policy.map
    m.set_u32(P_GATE, 0xDEADBEEF)
    assert m.u32(P_GATE) == 0xDEADBEEF
    m.set_u64(P_HEARTBEAT, 2**63 + 5)
    assert m.u64(P_HEARTBEAT) == 2**63 + 5
    gen = policy.set_gate(0b10)
    assert policy.gate == (gen << 16) | 0b10


def test_futex_wait_times_out_returns_at_once_on_a_changed_word_and_wakes(policy):
    m = policy.map
    m.set_u32(P_GATE, 7)
    assert m.futex_wait(P_GATE, 7, 0.01) is False  # nobody woke it: timed out
    assert m.futex_wait(P_GATE, 8, 5.0) is True  # the word is not 8: no sleep at all

    woke = threading.Event()

    def sleeper() -> None:
        if m.futex_wait(P_GATE, 9, 30.0):
            woke.set()

    m.set_u32(P_GATE, 9)
    t = threading.Thread(target=sleeper)
    t.start()
    deadline = time.monotonic() + 30
    while not woke.is_set() and time.monotonic() < deadline:  # a wake sent before it sleeps is lost
        m.futex_wake(P_GATE)  # the word stays 9: only the wake can end its 30 s sleep
        woke.wait(0.01)
    t.join(30)
    assert woke.is_set()
