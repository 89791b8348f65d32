"""PNG plots of a comparison: one figure per configuration set, one panel per figure of merit.

Bars are medians over repetitions, whiskers span min to max, and every
repetition is a dot, so the noise between runs is visible next to the
difference between configurations. Sets with several tenants get one bar per
tenant in each configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt

from gpuscope.loadtest.report import ALL, COLUMNS, RunResult, by_config, spread


def plot_set(results: Sequence[RunResult], set_name: str, path: Path, title: str = "") -> Path:
    """Write the figure of one configuration set; returns its path."""
    grouped = {c: rs for c, rs in by_config(results).items() if c.set == set_name}
    configs = list(grouped)
    scopes = sorted({t for rs in grouped.values() for r in rs for t in r.summaries if t != ALL}) or [ALL]
    if len(scopes) == 1:
        scopes = [ALL]
    figure, axes = plt.subplots(2, 4, figsize=(16, 7), constrained_layout=True)
    width = 0.8 / len(scopes)
    for ax, column in zip(axes.flat, COLUMNS, strict=False):
        for k, scope in enumerate(scopes):
            xs, medians, lows, highs = [], [], [], []
            for i, config in enumerate(configs):
                s = spread(grouped[config], column, scope)
                if s.median is None:
                    continue
                x = i + (k - (len(scopes) - 1) / 2) * width
                xs.append(x)
                medians.append(s.median)
                lows.append(s.median - s.low)
                highs.append(s.high - s.median)
                ax.scatter([x] * len(s.values), s.values, s=10, color="black", zorder=3)
            label = None if scope == ALL else scope
            ax.bar(xs, medians, width * 0.9, yerr=[lows, highs], capsize=3, alpha=0.75, label=label)
        ax.set_title(column.heading)
        ax.set_ylim(bottom=0)
        ax.set_xticks(range(len(configs)), [c.label for c in configs], rotation=20)
        ax.grid(axis="y", alpha=0.3)
        if len(scopes) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(COLUMNS):]:
        ax.axis("off")
    figure.suptitle(title or f"{set_name}: median of repetitions, whiskers min–max, dots each run")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
