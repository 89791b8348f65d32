"""The pieces under the verdicts: /proc parsing, histogram quantiles, exposition parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscope.diagnose import scrape
from gpuscope.diagnose.host import HostSampler

STAT = """cpu  {u} 0 {s} {i} 0 0 0 0 0 0
cpu0 {u0} 0 0 {i0} 0 0 0 0 0 0
cpu1 {u1} 0 0 {i1} 0 0 0 0 0 0
intr 1 2 3
"""
MEMINFO = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n"


def test_host_cpu_is_whole_host_and_busiest_core(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO)
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(u=0, s=0, i=0, u0=0, i0=0, u1=0, i1=0))
    host = HostSampler(str(tmp_path))
    first = host.read()
    assert first.cpu is None and first.ram_used_ratio == pytest.approx(0.75)
    # core 0: 95 busy of 100; core 1: 5 of 100 → host 100 of 200
    stat.write_text(STAT.format(u=95, s=5, i=100, u0=95, i0=5, u1=5, i1=95))
    second = host.read()
    assert second.cpu == pytest.approx(0.5) and second.busiest_core == pytest.approx(0.95)


def test_host_without_proc_reads_nothing(tmp_path: Path) -> None:
    reading = HostSampler(str(tmp_path / "absent")).read()
    assert reading.cpu is None and reading.ram_used_ratio is None


def test_quantile_interpolates_within_a_bucket_like_prometheus() -> None:
    before = {0.1: 0.0, 0.5: 0.0, float("inf"): 0.0}
    after = {0.1: 10.0, 0.5: 30.0, float("inf"): 40.0}
    assert scrape.quantile(0.25, before, after) == pytest.approx(0.1)        # rank 10: top of bucket 1
    assert scrape.quantile(0.5, before, after) == pytest.approx(0.3)         # rank 20: half-way in (0.1, 0.5]
    assert scrape.quantile(0.99, before, after) == pytest.approx(0.5)        # +Inf bucket: its lower bound
    assert scrape.quantile(0.5, after, after) is None                        # nothing observed in between


def test_parse_reads_vllm_names_and_sums_engines() -> None:
    text = (
        '# TYPE vllm:num_requests_running gauge\n'
        'vllm:num_requests_running{model_name="m",engine="0"} 3\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 4\n'
        '# TYPE vllm:gpu_cache_usage_perc gauge\n'
        'vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.5\n'
        'vllm:gpu_cache_usage_perc{model_name="m",engine="1"} 0.25\n'
    )
    reading = scrape.parse(text)
    assert reading.source == "vllm"
    # The KV cache's name before vLLM 0.9; each engine's usage is a share of its own cache: the fullest.
    assert reading.gauges == {"running": 7.0, "kv_cache": 0.5}


def test_live_frame_shows_progress_and_the_latest_table() -> None:
    from gpuscope.diagnose import view
    from gpuscope.diagnose.host import HostReading
    from gpuscope.diagnose.live import Tick, Window

    gpus = {"0": {"gpuscope_gpu_utilization_ratio": {"": 0.42}, "gpuscope_gpu_memory_used_bytes": {"": 50.0},
                  "gpuscope_gpu_memory_total_bytes": {"": 100.0}}}
    window = Window(ticks=[Tick(1.0, HostReading(0.25, 0.5, 0.1), gpus, None)], started=0.0)
    frame = view.live_frame(window, 0.5, "box")
    assert frame.startswith(view.CLEAR) and "[###############...............]  50%" in frame
    assert "CPU  25%" in frame and " 42%" in frame and " 50%" in frame  # util and memory of GPU 0


def test_malformed_exposition_is_an_unreachable_server_not_a_crash() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpuscope.diagnose.live import LiveSampler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"gpuscope_request_ttft_seconds_bucket{tenant=\"a\"} 1\nnot an exposition {{{\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        sampler = LiveSampler(0.2, 0.1, f"http://127.0.0.1:{httpd.server_address[1]}/metrics")
        assert sampler._server() is None and sampler.window.server_error
    finally:
        httpd.shutdown()
        httpd.server_close()
