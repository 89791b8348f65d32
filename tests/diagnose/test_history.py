"""``--prometheus URL --since``: a past window judged from recorded series in a real Prometheus.

The recorded series (names from ``contract/names.py``, labels as the generated rules record them)
are backfilled with ``promtool tsdb create-blocks-from openmetrics`` into a fresh TSDB, a real
Prometheus serves it, and the command's queries run against it. Two hosts: ``gpuhost`` tokenizes on
every core with an idle GPU and a launch-bound op; ``memhost`` has a full, swinging GPU that
throttles, reported XID 79 and whose memory floor grows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpuscope.contract import names
from gpuscope.ops import procs
from gpuscope.util.freeport import free_port
from tests.conftest import require_binary

STEP_S = 15
SPAN_S = 15 * 60
EXPORTER, SERVER = 'job="gpuscope-exporter"', 'job="gpuscope-server"'


def _series(t0: int) -> dict[str, list[float]]:
    n = SPAN_S // STEP_S
    const = lambda v: [v] * n  # noqa: E731
    gpuhost_gpu = f'{EXPORTER},instance="gpuhost:9400",gpu="0"'
    memhost_gpu = f'{EXPORTER},instance="memhost:9400",gpu="0"'
    out = {}
    for host, busy in (("gpuhost", 0.95), ("memhost", 0.5)):
        for cpu in ("0", "1"):
            # idle seconds grow by (1 - busy) per second on each core
            out[f'node_cpu_seconds_total{{job="node",instance="{host}:9100",cpu="{cpu}",mode="idle"}}'] = [
                i * STEP_S * (1 - busy) for i in range(n)]
        out[f'{names.HOST_CPU_BUSY}{{host="{host}",instance="{host}:9100"}}'] = const(busy)
        out[f'{names.HOST_RAM_USED}{{host="{host}",instance="{host}:9100"}}'] = const(0.4)
    out[f"{names.GPU_UTILIZATION}{{{gpuhost_gpu}}}"] = const(0.1)
    out[f"{names.GPU_MEMORY_USED}{{{gpuhost_gpu}}}"] = const(40.0)
    out[f"{names.GPU_MEMORY_TOTAL}{{{gpuhost_gpu}}}"] = const(80.0)
    out[f'{names.REQUESTS_RUNNING}{{{SERVER},instance="gpuhost:8000",tenant="alpha"}}'] = const(0.0)
    for le, rate in (("0.1", 1.0), ("+Inf", 1.0)):
        labels = f'{SERVER},instance="gpuhost:8000",tenant="alpha",le="{le}"'
        out[f"{names.TTFT_BUCKET_RATE}{{{labels}}}"] = const(rate)
    out[f"{names.GPU_UTILIZATION}{{{memhost_gpu}}}"] = [float(i % 2) for i in range(n)]
    out[f"{names.GPU_MEMORY_USED}{{{memhost_gpu}}}"] = const(97.0)
    out[f"{names.GPU_MEMORY_TOTAL}{{{memhost_gpu}}}"] = const(100.0)
    out[f'{names.GPU_CLOCK_EVENT_RATIO}{{{memhost_gpu},reason="hw_thermal_slowdown"}}'] = const(0.8)
    out[f'{names.GPU_XID_RECENT}{{{memhost_gpu},xid="79"}}'] = const(1.0)
    out[f"{names.GPU_MEMORY_GROWTH_RATE}{{{memhost_gpu}}}"] = const(1e6)  # the leak rules' floor grows
    out[f'{names.REGION_GPU_BUSY_RATIO}{{{SERVER},instance="gpuhost:8000",op="lm_head",device="cuda:0"}}'] = (
        const(0.2))
    return out


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> Iterator[str]:
    promtool, binary = require_binary("promtool"), require_binary("prometheus")
    root = tmp_path_factory.mktemp("history")
    t0 = int(time.time()) - SPAN_S - 30
    lines = []
    for series, values in _series(t0).items():
        lines += [f"{series} {v} {t0 + i * STEP_S}" for i, v in enumerate(values)]
    (root / "input.om").write_text("\n".join(lines) + "\n# EOF\n")
    data = root / "data"
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(root / "input.om"), str(data)],
                   check=True, capture_output=True, timeout=120)
    (root / "prometheus.yml").write_text("global:\n  evaluation_interval: 1m\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    child = procs.Child([binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={data}",
                         f"--web.listen-address=127.0.0.1:{port}"], name="prometheus",
                        log_path=root / "prometheus.log", ready=url + "/-/ready").start()
    try:
        child.wait_ready(60)
        yield url
    finally:
        child.stop()


def diagnose(url: str, *extra: str) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "diagnose", "--prometheus", url,
                             "--since", "10m", "--json", *extra], capture_output=True, text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


def test_past_window_is_judged_per_host(prometheus: str) -> None:
    status, document = diagnose(prometheus)
    by_host = {s["summary"]["host"]: s for s in document["summaries"]}
    assert set(by_host) == {"gpuhost", "memhost"}
    gpuhost, memhost = by_host["gpuhost"], by_host["memhost"]
    assert {f["code"] for f in gpuhost["findings"]} == {"input_bound", "launch_bound_ops"}
    assert gpuhost["summary"]["server"]["ops"]["lm_head"]["busy_ratio"] == pytest.approx(0.2)
    assert gpuhost["summary"]["cpu"] == pytest.approx(0.95, abs=0.01)  # from node_exporter's idle counter
    assert gpuhost["summary"]["server"]["ttft_p50_s"] == pytest.approx(0.05)
    assert {f["code"] for f in memhost["findings"]} == {"memory_pressure", "thermal_throttling", "xid",
                                                        "memory_leak"}
    gpu = memhost["summary"]["gpus"][0]
    assert gpu["memory_used_ratio"] == pytest.approx(0.97) and gpu["util_min"] == 0 and gpu["util_max"] == 1
    assert gpu["xids"] == {"79": 1.0}
    assert status == document["exit_status"] == 1


def test_host_flag_picks_one_host_and_text_names_the_numbers(prometheus: str) -> None:
    _, document = diagnose(prometheus, "--host", "gpuhost")
    assert [s["summary"]["host"] for s in document["summaries"]] == ["gpuhost"]
    text = subprocess.run([sys.executable, "-m", "gpuscope", "diagnose", "--prometheus", prometheus,
                           "--since", "10m", "--host", "gpuhost"],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 1
    assert "PROBLEM input_bound" in text.stdout and "host_cpu=0.95" in text.stdout


def test_window_without_data_exits_3(prometheus: str) -> None:
    result = subprocess.run([sys.executable, "-m", "gpuscope", "diagnose", "--prometheus", prometheus,
                             "--host", "nohost"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and "no series" in result.stderr
