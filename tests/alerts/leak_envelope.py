"""Which linear leaks the memory alerts page with at least ``LEAD_MIN`` minutes to spare.

A grid of leaks, each a straight line from ``start`` (share of an 80 GiB device) to exhaustion in
``minutes``: from the process's first sample ("young") and after an hour flat at ``start``
("settled"). :func:`render` writes them as one promtool test file whose checks ask, every
evaluation, which memory alert fires for which leak; promtool prints what it got where a check
expected nothing, which :func:`first_pages` reads back. ``python -m tests.alerts.leak_envelope``
prints the table (docs/alerts.md quotes it); ``tests/alerts/test_rules.py`` holds the leaks the
rules are designed to catch (:data:`COVERED`) to the lead.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.alerts.memory_shapes import CAPACITY, PROFILES, _group_order

LEAD_MIN = 5
STARTS = (0.0, 0.2, 0.4, 0.6, 0.8)
EXHAUSTS_IN = (10, 15, 20, 30, 45, 60)
SETTLED_FOR = 60
ALERTS = "GPUMemoryLeak|GPUMemoryRunningOut"


@dataclass(frozen=True)
class Leak:
    start: float
    minutes: int
    settled: bool

    @property
    def name(self) -> str:
        return f"{'settled' if self.settled else 'young'}-{round(self.start * 100)}pct-{self.minutes}m"

    @property
    def begins(self) -> int:
        return SETTLED_FOR if self.settled else 0

    @property
    def exhausted_at(self) -> int:
        return self.begins + self.minutes

    @property
    def pace(self) -> float:
        """Share of capacity per minute."""
        return (1 - self.start) / self.minutes

    def at(self, t: float) -> float:
        return min(1.0, self.start + self.pace * max(0.0, t - self.begins))


def grid() -> list[Leak]:
    return [Leak(s, m, settled) for settled in (False, True) for s in STARTS for m in EXHAUSTS_IN]


def covered(leak: Leak) -> bool:
    """The leaks the rules are designed to page in time: a pace between a load's and an allocate
    phase's (``climbing``: the device filled from empty in 20 to 40 minutes) with the 12-minute
    climb, the minute of ``for`` and the lead inside the time left; or, in a settled process (from a
    level a restart does not fall below: a quarter of the leak's peak), a leak that leaves
    ``sustained`` its 2-minute step, 10 minutes of ``for`` and the lead."""
    climbing = 1 / 40 <= leak.pace <= 1 / 20 and leak.minutes >= 12 + 1 + 1 + LEAD_MIN
    sustained = leak.settled and leak.start >= 0.25 * 0.8 and leak.minutes >= 2 + 10 + 1 + LEAD_MIN
    return climbing or sustained


COVERED = [leak for leak in grid() if covered(leak)]


def render(leaks: list[Leak], profile: str = "production") -> str:
    """One promtool test group per leak (each its own storage: the slow rule's subqueries over many
    series at once exceed promtool's sample limit), asking every evaluation until exhaustion."""
    p = next(x for x in PROFILES if x.name == profile)
    step_s = 30
    out = ["rule_files:", f"  - {p.rules}/sources.rules.yml", f"  - {p.rules}/gpuscope.rules.yml",
           *_group_order(p),  # records before the alerts that read them, as Prometheus runs them
           f"evaluation_interval: {p.evaluation_interval_s}s", "tests:"]
    for leak in leaks:
        n = leak.exhausted_at * 60 // step_s
        labels = f'job="gpuscope-server",instance="{leak.name}",device="cuda:0"'
        values = " ".join(str(round(leak.at(i * step_s / 60) * CAPACITY)) for i in range(n + 1))
        out += [f"  - name: {leak.name}", f"    interval: {step_s / p.compression:g}s", "    input_series:",
                f"      - series: 'gpuscope_device_memory_allocated_bytes{{{labels}}}'",
                f"        values: '{values}'",
                f"      - series: 'gpuscope_device_memory_total_bytes{{{labels}}}'",
                f"        values: '{CAPACITY}+0x{n}'", "    promql_expr_test:"]
        evals = leak.exhausted_at * 60 // p.evaluation_interval_s // p.compression
        for i in range(evals + 1):
            out += [f"      - expr: count by (instance, alertname, trigger) "
                    f"(ALERTS{{alertstate=\"firing\",alertname=~\"{ALERTS}\"}})",
                    f"        eval_time: {i * p.evaluation_interval_s}s", "        exp_samples: []"]
    return "\n".join(out) + "\n"


_CHECK = re.compile(r"expr: \"count by.*?\", time: (?:(\d+)h)?(?:(\d+)m)?(?:([\d.]+)s)?")
_GOT = re.compile(r'instance="([^"]+)"')


def _first_page(leak: Leak, profile: str) -> float | None:
    """Production minute of the leak's first memory page; None: none before exhaustion. One file per
    leak: promtool reports the failures of the first failing group only."""
    p = next(x for x in PROFILES if x.name == profile)
    root = Path(__file__).resolve().parent / "cases"
    folder = root / "test-profile" if profile == "test" else root
    with tempfile.NamedTemporaryFile("w", suffix=".leak.yml", dir=folder, delete=True) as fh:
        fh.write(render([leak], profile))
        fh.flush()
        result = subprocess.run(["promtool", "test", "rules", Path(fh.name).name], cwd=folder,
                                capture_output=True, text=True, check=False)
    minute = None
    for line in (result.stdout + result.stderr).splitlines():
        if m := _CHECK.search(line):
            h, mi, sec = (float(x) if x else 0.0 for x in m.groups())
            minute = (h * 3600 + mi * 60 + sec) * p.compression / 60
        elif _GOT.search(line) and minute is not None:
            return minute
    return None


def first_pages(leaks: list[Leak], profile: str = "production") -> dict[str, float | None]:
    """Leak name → production minute of its first memory page (None: never before exhaustion).

    One promtool process per leak, as many at a time as there are CPUs (each is single-threaded and
    writes its own file)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(leaks), os.cpu_count() or 1))) as pool:
        pages = pool.map(lambda leak: _first_page(leak, profile), leaks)
        return {leak.name: page for leak, page in zip(leaks, pages, strict=True)}


def table(profile: str = "production") -> str:
    """Minutes of lead per leak (— never before exhaustion), one matrix per kind of start."""
    pages = first_pages(grid(), profile)
    out = []
    for settled in (False, True):
        out += [f"Leak {'after an hour flat' if settled else 'from the process start'}; rows: memory "
                "at the leak's start, columns: minutes to exhaustion.", "",
                "| start | " + " | ".join(f"{m}m" for m in EXHAUSTS_IN) + " |",
                "| --- |" + " --- |" * len(EXHAUSTS_IN)]
        for start in STARTS:
            cells = []
            for minutes in EXHAUSTS_IN:
                leak = Leak(start, minutes, settled)
                at = pages[leak.name]
                cells.append("—" if at is None else f"{leak.exhausted_at - at:g}")
            out.append(f"| {start:.0%} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    print(table(sys.argv[1] if len(sys.argv) > 1 else "production"))
