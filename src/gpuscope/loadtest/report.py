"""Comparison results: one row per run in CSV, medians with their spread in Markdown.

Every figure comes from gpuscope's exact records (not Locust's rounded ones).
A Markdown cell reads ``median [min–max]`` over the repetitions, so a reader
sees at once whether two configurations differ by more than the noise.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from gpuscope.loadtest.configs import Config
from gpuscope.loadtest.stats import Summary


@dataclass(frozen=True)
class Column:
    """One reported figure: the Summary field, its heading, and the factor to its display unit."""

    field: str
    heading: str
    scale: float = 1.0
    digits: int = 1


#: The figures of every table, CSV and plot, in this order.
COLUMNS = (
    Column("rps", "req/s", 1.0, 2),
    Column("tps", "tok/s", 1.0, 0),
    Column("ttft_p50_s", "TTFT p50 ms", 1000.0, 1),
    Column("ttft_p99_s", "TTFT p99 ms", 1000.0, 1),
    Column("itl_p99_s", "ITL p99 ms", 1000.0, 2),
    Column("e2e_p99_s", "e2e p99 ms", 1000.0, 0),
    Column("error_rate", "errors %", 100.0, 2),
)
ALL = "all"


@dataclass
class RunResult:
    """One Locust run against one configuration: summaries for all tenants and each tenant."""

    config: Config
    rep: int
    summaries: dict[str, Summary]
    html: str = ""
    note: str = ""
    model: str = ""  # the model name the requests carried


@dataclass
class Spread:
    median: float | None
    low: float | None
    high: float | None
    values: list[float] = field(default_factory=list)


def value(summary: Summary, column: Column) -> float | None:
    raw = getattr(summary, column.field)
    return None if raw is None else raw * column.scale


def spread(results: Iterable[RunResult], column: Column, scope: str = ALL) -> Spread:
    """Median and range of one figure over the repetitions of one configuration."""
    values = [v for r in results if scope in r.summaries
              for v in [value(r.summaries[scope], column)] if v is not None]
    if not values:
        return Spread(None, None, None, [])
    return Spread(statistics.median(values), min(values), max(values), values)


def by_config(results: Sequence[RunResult]) -> dict[Config, list[RunResult]]:
    grouped: dict[Config, list[RunResult]] = {}
    for result in results:
        grouped.setdefault(result.config, []).append(result)
    return grouped


def _cell(s: Spread, digits: int) -> str:
    if s.median is None:
        return "–"
    if len(s.values) == 1 or s.low == s.high:
        return f"{s.median:.{digits}f}"
    return f"{s.median:.{digits}f} [{s.low:.{digits}f}–{s.high:.{digits}f}]"


def markdown(results: Sequence[RunResult], header: dict[str, str], plots: dict[str, str]) -> str:
    """The report: run settings, then one table per configuration set (and per tenant where it matters)."""
    lines = ["# gpuscope configuration comparison", ""]
    lines += [f"- **{key}**: {text}" for key, text in header.items()]
    lines += ["", "Cells are the median over repetitions with [min–max]; figures are gpuscope's exact "
              "records of the measured window (after warm-up), not Locust's rounded ones.", ""]
    grouped = by_config(results)
    sets = list(dict.fromkeys(c.set for c in grouped))
    for set_name in sets:
        configs = [c for c in grouped if c.set == set_name]
        lines += [f"## {set_name}", ""]
        lines += _table(["configuration", *(c.heading for c in COLUMNS)],
                        [[c.label, *(_cell(spread(grouped[c], col), col.digits) for col in COLUMNS)]
                         for c in configs])
        tenants = sorted({t for c in configs for r in grouped[c] for t in r.summaries if t != ALL})
        if len(tenants) > 1:
            lines += ["", "Per tenant:", ""]
            lines += _table(["configuration", "tenant", *(c.heading for c in COLUMNS)],
                            [[c.label, t, *(_cell(spread(grouped[c], col, t), col.digits) for col in COLUMNS)]
                             for c in configs for t in tenants])
        if set_name in plots:
            lines += ["", f"![{set_name}]({plots[set_name]})"]
        notes = [f"{r.config.label} rep {r.rep}: {r.note}" for c in configs for r in grouped[c] if r.note]
        if notes:
            lines += ["", *(f"- {n}" for n in notes)]
        lines.append("")
    return "\n".join(lines)


def _table(heads: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


#: Run identity, then every Summary field (base units: seconds, ratios), then where to look further
#: and what was loaded: gpuscope serve's flags, or a target's URL; the model the requests named.
CSV_FIELDS = ("set", "configuration", "rep", "scope", *(f.name for f in fields(Summary)),
              "html_report", "server_args", "url", "model")


def write_csv(results: Sequence[RunResult], path: Path) -> None:
    """One row per run and scope (all tenants, then each tenant), in base units (seconds, ratios)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            for scope, s in r.summaries.items():
                row: dict[str, object] = {
                    "set": r.config.set, "configuration": r.config.label, "rep": r.rep, "scope": scope,
                    "html_report": r.html, "server_args": " ".join(r.config.server_args),
                    "url": r.config.url, "model": r.model or r.config.model}
                for name, raw in s.as_dict().items():
                    row[name] = "" if raw is None else (f"{raw:.6g}" if isinstance(raw, float) else raw)
                writer.writerow(row)
