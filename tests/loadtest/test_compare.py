"""The comparison command: flags, the report it writes, and a short real run against gpuscope serve."""

from __future__ import annotations

import csv
import io

import matplotlib.image
import pytest

from gpuscope.loadtest import compare
from gpuscope.loadtest.configs import build
from gpuscope.loadtest.report import RunResult, markdown, write_csv
from gpuscope.loadtest.stats import Summary
from tests.conftest import usage_error


def _summary(rps: float, ttft_p99: float) -> Summary:
    return Summary(requests=100, errors=1, window_s=10.0, rps=rps, tps=rps * 30, error_rate=0.01,
                   ttft_p50_s=0.01, ttft_p99_s=ttft_p99, itl_p50_s=0.002, itl_p99_s=0.004,
                   e2e_p50_s=0.2, e2e_p99_s=0.5)


def test_configuration_sets():
    configs = build(["timing", "batching", "scheduler"], [4, 16])
    assert [c.key for c in configs] == ["timing-off", "timing-budget", "timing-all", "batching-off",
                                        "batching-max4", "batching-max16", "scheduler-fcfs",
                                        "scheduler-share"]
    assert configs[3].server_args == ("--no-batching",)
    assert {c.load_tenants for c in configs if c.set == "scheduler"} == {"alpha:3,beta:1"}
    with pytest.raises(ValueError, match="unknown configuration set 'colour'"):
        build(["colour"], [4])


def test_markdown_shows_median_and_spread_per_configuration_and_tenant(tmp_path):
    fcfs, share = build(["scheduler"], [])
    def run(config, rep, everyone, alpha, beta):
        return RunResult(config, rep, {"all": _summary(*everyone), "alpha": _summary(*alpha),
                                       "beta": _summary(*beta)})

    results = [
        run(fcfs, 1, (10, 0.100), (8, 0.1), (2, 0.3)),
        run(fcfs, 2, (12, 0.300), (9, 0.1), (3, 0.5)),
        run(fcfs, 3, (11, 0.200), (9, 0.1), (2, 0.4)),
        run(share, 1, (20, 0.050), (15, 0.1), (5, 0.05)),
    ]
    text = markdown(results, {"date": "today"}, {"scheduler": "compare-x-scheduler.png"})
    assert "| fcfs | 11.00 [10.00–12.00] | 330 [300–360] | 10.0 | 200.0 [100.0–300.0] |" in text
    assert "| share | 20.00 | 600 |" in text  # one repetition: no range
    assert "| fcfs | beta | 2.00 [2.00–3.00] |" in text
    assert "![scheduler](compare-x-scheduler.png)" in text
    write_csv(results, tmp_path / "x.csv")
    rows = list(csv.DictReader((tmp_path / "x.csv").read_text().splitlines()))
    assert len(rows) == 12 and rows[0]["scope"] == "all" and float(rows[1]["ttft_p99_s"]) == 0.1


@pytest.mark.parametrize(("argv", "needle"), [
    (["--sets", "timing,colour"], "unknown configuration set 'colour'"),
    (["--batch.sizes", "1,4"], "batch sizes must be at least 2"),
    (["--run.duration", "soon"], "is not a duration"),
    (["--load.prompt-tokens", "gauss:x=1"], "unknown distribution"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_bad_flags_fail_with_one_line(argv, needle):
    assert needle in usage_error("gpuscope.loadtest.compare", *argv)


@pytest.mark.slow
def test_short_comparison_against_real_servers_writes_table_csv_plots_and_html(tmp_path):
    progress = io.StringIO()
    code = compare.main(["--sets", "batching", "--batch.sizes", "4", "--repeats", "2",
                         "--run.duration", "2s", "--run.warmup", "1s", "--run.users", "3",
                         "--load.output-tokens", "uniform:min=4,max=12", "--server.args", "--model.layers 1",
                         "--output.dir", str(tmp_path), "--output.name", "ci"], progress=progress)
    assert code == 0, progress.getvalue()
    md = (tmp_path / "compare-ci.md").read_text()
    assert "| off |" in md and "| max4 |" in md and "![batching](compare-ci-batching.png)" in md
    rows = list(csv.DictReader((tmp_path / "compare-ci.csv").read_text().splitlines()))
    runs = {(r["configuration"], r["rep"]) for r in rows}
    assert runs == {("off", "1"), ("max4", "1"), ("off", "2"), ("max4", "2")}
    assert all(float(r["rps"]) > 0 and float(r["error_rate"]) == 0 for r in rows)
    image = matplotlib.image.imread(tmp_path / "compare-ci-batching.png")
    assert image.shape[0] > 400 and image.shape[1] > 800
    for config, rep in runs:
        html = tmp_path / "compare-ci-runs" / f"batching-{config}-r{rep}" / "locust.html"
        assert html.stat().st_size > 10_000
    # Progress: one line per run, in the interleaved order.
    started = [line for line in progress.getvalue().splitlines() if line.startswith("[")]
    assert started == ["[1/4] batching/off rep 1/2", "[2/4] batching/max4 rep 1/2",
                       "[3/4] batching/off rep 2/2", "[4/4] batching/max4 rep 2/2"]

