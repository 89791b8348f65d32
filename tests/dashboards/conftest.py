"""A live no-Docker stack with traffic, shared by the dashboard end-to-end tests."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml

from gpuscope.alerting import generate, sources
from gpuscope.contract import catalogue
from gpuscope.contract.profiles import TEST
from gpuscope.ops import procs
from gpuscope.ops.stack import Stack, StackOptions
from gpuscope.util.freeport import free_port
from tests.conftest import require_binary, wait_for

TENANTS = ("alpha", "beta")
#: Tenants of the share controller beside the stack: one capped (1 GiB), one without a cap.
SHARE_TENANTS = "capped=0.5:0:1GiB,uncapped=0.5"
SCRAPE_INTERVAL_S = 5  # deploy/prometheus/prometheus.yml
TTFT_COUNT = catalogue.REQUEST_TTFT.series("_count")


def prom_query(stack: Stack, query: str, **params) -> list:
    r = requests.post(stack.url("prometheus") + "/api/v1/query", data={"query": query, **params}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def send_traffic(stack: Stack, requests_per_tenant: int = 12) -> int:
    """Completions from every tenant, half streamed (SSE), four at a time; returns how many succeeded."""
    url = stack.url("server") + "/v1/completions"

    def one(i: int, tenant: str) -> bool:
        body = {"prompt": f"request {i} from {tenant}", "max_tokens": 6 + i % 5, "stream": i % 2 == 0}
        with requests.post(url, json=body, headers={"X-Tenant": tenant}, stream=True, timeout=60) as r:
            _ = r.content  # read the whole event stream
            return r.status_code == 200

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(one, i, t) for i in range(requests_per_tenant) for t in TENANTS]
        return sum(job.result() for job in jobs)


class LokiSink:
    """Stands in for Loki, which cannot run here: takes pushes in Loki's documented JSON format.

    Keeps every (stream labels, line, structured metadata) so tests can check that the labels and
    metadata the dashboards and the exemplar link select on are what the server really sends.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[dict, str, dict]] = []
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/loki/api/v1/push"
                if ok:
                    with sink.lock:
                        for stream in json.loads(body)["streams"]:
                            for value in stream["values"]:
                                meta = value[2] if len(value) > 2 else {}
                                sink.entries.append((stream["stream"], value[1], meta))
                self.send_response(204 if ok else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def loki_sink():
    sink = LokiSink()
    yield sink
    sink.close()


class StackWithShare(Stack):
    """The stack, with Prometheus also scraping a `gpuscope share` controller under the share source's
    job and loading that source's layer, so the panels only the controller feeds are evaluated too."""

    def __init__(self, options: StackOptions, share_address: str) -> None:
        super().__init__(options)
        self.share_address = share_address

    def render_configs(self) -> None:
        super().render_configs()
        path = self.run_dir / "prometheus.yml"
        config = yaml.safe_load(path.read_text())
        config["scrape_configs"].append({
            "job_name": sources.stack_job(sources.GPUSCOPE_SHARE.name, TEST),
            "static_configs": [{"targets": [self.share_address], "labels": {"host": "local"}}]})
        layer = self.options.root / generate.source_rules_path(TEST, sources.GPUSCOPE_SHARE.name)
        config["rule_files"].append(str(layer))
        path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def share_controller(tmp_path_factory) -> Iterator[str]:
    """A `gpuscope share` controller on CPU (no tenant process joins): its /metrics address."""
    folder: Path = tmp_path_factory.mktemp("share")
    address = f"127.0.0.1:{free_port()}"
    child = procs.Child([sys.executable, "-m", "gpuscope", "share", "--share", SHARE_TENANTS,
                         "--share.ledger", str(folder / "ledger"), "--web.listen-address", address],
                        name="share", log_path=folder / "share.log", ready=f"http://{address}/healthz",
                        die_with_parent=True)
    with child:
        child.wait_ready(30)
        yield address


@pytest.fixture(scope="module")
def live_stack(loki_sink, share_controller):
    """The stack (test profile, free ports) after traffic and enough scrapes for rate() windows, with a
    share controller scraped beside it. Per module (test_live.py is its one user): it stops when that
    module is done instead of scraping and evaluating rules through the rest of the session."""
    for binary in ("prometheus", "prometheus-alertmanager", "prometheus-node-exporter"):
        require_binary(binary)
    options = StackOptions(profile="test", ports="free",
                           server_args=["--tenants", ",".join(f"{t}:0.5" for t in TENANTS),
                                        "--loki.url", loki_sink.url])
    with StackWithShare(options, share_controller) as stack:
        stack.started_at = time.time()
        # Traffic before the first scrape would land in the first sample: rate() would never see it move.
        wait_for(lambda: prom_query(stack, "count(up == 1) == 7"), timeout=30, interval=0.2,
                 what="Prometheus scraping all seven targets (the stack's six and the share controller)")
        assert send_traffic(stack) == 2 * 12
        # Data for every rate()/increase() window: the server's counters moved between two scrapes, and
        # every target has been scraped often enough to fill a $__rate_interval of four scrapes.
        wait_for(lambda: prom_query(stack, f"sum(rate({TTFT_COUNT}[20s])) > 0"),
                 timeout=60, interval=0.5, what="server histograms in Prometheus")
        wait_for(lambda: prom_query(stack, "min(count_over_time(up[1m])) >= 5"), timeout=90,
                 interval=0.5, what="five scrapes of every target")
        send_traffic(stack, 4)  # fresh samples inside the last windows too
        wait_for(lambda: prom_query(stack, f"sum(rate({TTFT_COUNT}[10s])) > 0"),
                 timeout=60, interval=0.5, what="the second burst scraped")
        yield stack
