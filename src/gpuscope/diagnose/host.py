"""Host CPU and memory from /proc (no dependency): busy share of the whole host and of its busiest core."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostReading:
    cpu: float | None  # whole host, 0..1, since the previous reading
    busiest_core: float | None
    ram_used_ratio: float | None
    cores: int | None = None  # how many cpuN lines /proc/stat has


def _cpu_times(text: str) -> dict[str, tuple[int, int]]:
    """``cpu``/``cpuN`` line → (busy jiffies, total jiffies); idle counts idle + iowait."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        values = [int(v) for v in parts[1:9]]  # user nice system idle iowait irq softirq steal
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        out[parts[0]] = (sum(values) - idle, sum(values))
    return out


def _share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    total = after[1] - before[1]
    return None if total <= 0 else max(0.0, min(1.0, (after[0] - before[0]) / total))


def ram_used_ratio(meminfo: str) -> float | None:
    """1 − MemAvailable / MemTotal, as node_exporter-based dashboards compute it."""
    fields = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if rest.split():
            fields[name] = int(rest.split()[0])
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    return None if not total or available is None else 1 - available / total


class HostSampler:
    """Reads ``<proc_root>/stat`` and ``<proc_root>/meminfo``; each reading covers the time since the last."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.root = Path(proc_root)
        self._last: dict[str, tuple[int, int]] | None = None

    def read(self) -> HostReading:
        try:
            times = _cpu_times((self.root / "stat").read_text())
        except OSError:
            times = {}
        try:
            ram = ram_used_ratio((self.root / "meminfo").read_text())
        except OSError:
            ram = None
        last, self._last = self._last, times
        count = sum(name != "cpu" for name in times) or None
        if not last or "cpu" not in times or "cpu" not in last:
            return HostReading(None, None, ram, count)
        cores = [s for name, t in times.items() if name != "cpu" and name in last
                 if (s := _share(last[name], t)) is not None]
        return HostReading(_share(last["cpu"], times["cpu"]), max(cores) if cores else None, ram, count)
