"""``gpuscope serve --metrics.names vllm``: the serving metrics as vLLM exposes them, and ``ignore_eos``."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gpuscope.alerting import sources
from gpuscope.contract import upstream
from gpuscope.server.config import ConfigError
from tests.contract.test_sources import CURRENT, _buckets, _family, families
from tests.server.conftest import ServerThread, small_config


@pytest.fixture(scope="module")
def vllm_server():
    srv = ServerThread(small_config(metric_names="vllm", model_name="llama-mini")).start()
    yield srv
    srv.stop()


#: What Prometheus asks for: OpenMetrics first, the text format after.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,"
                     "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3")


def exposition(srv: ServerThread) -> dict[str, object]:
    r = requests.get(srv.url + "/metrics", headers={"Accept": PROMETHEUS_ACCEPT}, timeout=30)
    assert r.headers["Content-Type"].startswith("text/plain")  # vLLM's names keep their colons
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def test_unknown_metric_names_are_refused():
    with pytest.raises(ConfigError, match=r"--metrics\.names"):
        small_config(metric_names="triton")


def test_vllm_names_labels_and_buckets_are_the_fixtures(vllm_server):
    for i, stream in enumerate((False, True, False)):
        r = vllm_server.complete(f"request {i}", max_tokens=6, ignore_eos=True, stream=stream,
                                 tenant=("alpha", "beta")[i % 2])
        assert r.status_code == 200, r.text
    served, fixture = exposition(vllm_server), families(CURRENT["vllm"])
    for metric in upstream.VLLM_METRICS:
        mine, theirs = _family(served, metric), _family(fixture, metric)
        assert mine.type == theirs.type and mine.documentation == theirs.documentation, metric.name
        labels = {label for s in mine.samples for label in s.labels} - {"le"}
        assert labels == {label for s in theirs.samples for label in s.labels} - {"le"}, metric.name
        assert {(s.labels["model_name"], s.labels["engine"]) for s in mine.samples} == {("llama-mini", "0")}
        if metric.buckets:
            assert _buckets(mine) == _buckets(theirs), metric.name
    # Every tenant's requests count for the one served model, as vLLM's one scheduler counts them.
    success = {s.labels["finished_reason"]: s.value for s in served["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert success["length"] == 3 and set(success) == set(upstream.VLLM_FINISH_REASONS)
    ttft = served["vllm:time_to_first_token_seconds"].samples
    assert next(s.value for s in ttft if s.name.endswith("_count")) == 3


def test_vllm_names_leave_gpuscope_serving_and_timer_series_out(vllm_server):
    """What the vLLM source reads is there; what only gpuscope serve has (kernel timing, tenants) is not."""
    served = exposition(vllm_server)
    assert not [name for name in served if name.startswith(("gpuscope_region", "gpuscope_request",
                                                             "gpuscope_tenant", "gpuscope_queue"))]
    series = {s.name.removesuffix("_total") for f in served.values() for s in f.samples} | set(served)
    read = {raw.metric for raw in sources.VLLM.raw.values()}
    assert {name.removesuffix("_total") for name in read} <= series


@pytest.fixture(scope="module")
def eos_server():
    """Every token the model can make is an end-of-sequence token: a request stops at its first."""
    srv = ServerThread(small_config())
    srv.service.engine._eos = frozenset(range(srv.service.model.lm_head.out_features))
    yield srv.start()
    srv.stop()


def test_ignore_eos_generates_max_tokens(eos_server):
    stops = eos_server.complete("stops", max_tokens=24).json()
    assert stops["usage"]["completion_tokens"] == 1 and stops["choices"][0]["finish_reason"] == "stop"
    for stream in (False, True):
        r = eos_server.complete("ignores eos", max_tokens=24, ignore_eos=True, stream=stream,
                                stream_options={"include_usage": True})
        assert r.status_code == 200, r.text
        if not stream:
            body = r.json()
            assert body["usage"]["completion_tokens"] == 24
            assert body["choices"][0]["finish_reason"] == "length"
        else:
            assert '"finish_reason": "length"' in r.text and '"completion_tokens": 24' in r.text
    r = eos_server.complete("bad", ignore_eos="yes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
