"""The server's /metrics carries its process' start time: the memory alerts tell a restart from it."""

from __future__ import annotations

import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerThread, small_config


def test_metrics_carry_the_process_start_time() -> None:
    srv = ServerThread(small_config()).start()
    try:
        text = requests.get(srv.url + "/metrics", timeout=30).text
    finally:
        srv.stop()
    starts = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "process_start_time_seconds"]
    assert len(starts) == 1
    assert 0 < time.time() - starts[0] < 24 * 3600  # this process, started today
