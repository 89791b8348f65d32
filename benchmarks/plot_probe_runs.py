#!/usr/bin/env python3
"""Throughput loss per configuration across runs of ``hot_path_probes.py``, drawn side by side.

    python benchmarks/plot_probe_runs.py benchmarks/results/recycle-interval-h200.json \\
        benchmarks/results/recycler-probe-h200-2.json --out /tmp/recycler.png

(``benchmarks/README.md`` gives the command that drew ``results/recycler-h200.png``.)

One group of bars per configuration (in the order the files first name them), one bar per run.
Runs on a shared VM differ by more than configurations do, so each run's own floor
(``raw_shared``, one raw record a region) is drawn as a line across its bars: compare a bar with
the line of its own colour, not with another run's bar.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

FLOOR = "raw_shared"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="JSON files written by hot_path_probes.py")
    parser.add_argument("--out", required=True, help="PNG to write")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in args.runs:
        try:
            with open(path) as f:
                runs.append((os.path.basename(path), json.load(f)["configs"]))
        except (OSError, ValueError, KeyError) as exc:
            print(f"plot_probe_runs: {path}: not a hot_path_probes.py result ({exc})", file=sys.stderr)
            return 2
    names = list(dict.fromkeys(name for _, configs in runs for name in configs))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(names)), 4.5))
    for i, (label, configs) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j, name in enumerate(names) if name in configs]
        losses = [configs[name]["loss_pct"] for name in names if name in configs]
        bars = ax.bar(xs, losses, width, label=label)
        if FLOOR in configs:
            ax.axhline(configs[FLOOR]["loss_pct"], color=bars.patches[0].get_facecolor(), lw=1, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([name.replace("gpuscope_full_partition", "shared") for name in names], rotation=30,
                       ha="right")
    ax.set_ylabel("throughput loss, % (summed paired block walls)")
    ax.set_title(f"bs 1 × 64, every region timed; dashed: each run's {FLOOR} floor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
