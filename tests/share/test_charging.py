"""The charger as pure code: posted GPU time is charged as it is; a tenant beside the holder, whose
windows are not timed, is charged its probed kernel time for each launch it made."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from gpuscope.share.charging import Charger
from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.processes import ProcState
from gpuscope.share.scheduler import SliceScheduler


@dataclass
class View:
    slot: int
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def counter(self, name: str) -> int:
        return self.counts[name]


class Table:
    def __init__(self, *slots: int) -> None:
        self.states = [ProcState(View(slot)) for slot in slots]

    def __iter__(self):
        return iter(self.states)

    def tenant_name(self, slot: int) -> str:
        return "holder" if slot == 0 else "beside"

    def post(self, slot: int, gpu_s: float = 0.0, launches: int = 0) -> None:
        view = self.states[slot].view
        view.counts["gpu_ns"] += round(gpu_s * 1e9)
        view.counts["launches"] += launches


def charger() -> tuple[Charger, Table, dict[str, float]]:
    table, charged = Table(0, 1), defaultdict(float)
    scheduler = SliceScheduler([TenantPolicy("holder", 0.7), TenantPolicy("beside", 0.3)])
    return Charger(table, scheduler, charged, now=0.0), table, charged


def test_a_tenant_beside_is_charged_its_kernel_time_a_launch_for_the_launches_it_made():
    c, table, charged = charger()
    beside = {1: 2e-4}  # its probes: 200 µs of kernels a launch
    # alone-speed: 1000 launches in a second; beside a GPU-bound holder it made 400
    table.post(0, gpu_s=0.5, launches=50)
    table.post(1, launches=400)
    c.charge(1.0, holder=0, beside_launch_s=beside, concurrent=True, gate_open=False)
    assert charged["beside"] == pytest.approx(400 * 2e-4)  # 0.08 s, not its busy fraction of the second
    assert charged["holder"] == pytest.approx(0.5)
    table.post(1, gpu_s=0.3)  # a probe's windows: the per-launch figure already stands for them
    c.charge(2.0, holder=0, beside_launch_s=beside, concurrent=True, gate_open=False)
    assert charged["beside"] == pytest.approx(0.08)


def test_a_tenant_taking_turns_is_charged_what_it_posted_and_its_launches_are_not_counted_later():
    c, table, charged = charger()
    table.post(1, gpu_s=0.2, launches=300)  # taking turns: its windows post
    c.charge(1.0, holder=1, beside_launch_s={}, concurrent=False, gate_open=False)
    assert charged["beside"] == pytest.approx(0.2)
    table.post(1, launches=10)  # then beside: only the launches made since count
    c.charge(2.0, holder=0, beside_launch_s={1: 1e-3}, concurrent=True, gate_open=False)
    assert charged["beside"] == pytest.approx(0.2 + 10 * 1e-3)


def test_a_page_whose_counts_go_back_charges_nothing_negative():
    c, table, charged = charger()
    table.post(1, launches=100)
    c.charge(1.0, holder=0, beside_launch_s={1: 1e-3}, concurrent=True, gate_open=False)
    table.states[1].view.counts["launches"] = 5  # the tenant's own page: it may write anything there
    c.charge(2.0, holder=0, beside_launch_s={1: 1e-3}, concurrent=True, gate_open=False)
    assert charged["beside"] == pytest.approx(0.1)
