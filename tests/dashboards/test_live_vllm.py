"""Every dashboard query against the no-Docker stack with the vLLM source: ``gpuscope stack --stack.source
vllm`` runs gpuscope serve under vLLM's metric names, scraped as job vllm, with the vLLM layer loaded.

What the generated support table (docs/sources.md) says vLLM feeds must show data; what reads nothing
vLLM exposes (kernel timing, tenant GPU time, the server's own memory) must stay empty, so the table
cannot claim more than the stack shows. The GPU side is gpuscope exporter on a machine without a GPU:
the reviewed no-GPU allow-list applies as in test_live.py.
"""

from __future__ import annotations

import time

import pytest

from gpuscope.contract.profiles import TEST
from gpuscope.docgen.sources import Support
from gpuscope.ops.stack import Stack, StackOptions
from tests.conftest import require_binary, wait_for
from tests.dashboards.conftest import TENANTS, prom_query, send_traffic
from tests.dashboards.no_data_allowlist import ALLOWED_EMPTY, MAY_BE_EMPTY
from tests.dashboards.panels import queries
from tests.dashboards.test_live import _target_ref, evaluate

pytestmark = [pytest.mark.slow, pytest.mark.distro]


@pytest.fixture(scope="module")
def vllm_stack():
    for binary in ("prometheus", "prometheus-alertmanager", "prometheus-node-exporter"):
        require_binary(binary)
    options = StackOptions(profile="test", ports="free", source="vllm",
                           server_args=["--tenants", ",".join(f"{t}:0.5" for t in TENANTS)])
    with Stack(options) as stack:
        stack.started_at = time.time()
        wait_for(lambda: prom_query(stack, 'count(up{job="vllm"} == 1) == 1 and count(up == 1) == 6'),
                 timeout=30, interval=0.2, what="Prometheus scraping every target, the server as job vllm")
        assert send_traffic(stack) == 2 * 12
        wait_for(lambda: prom_query(stack, "sum(gpuscope:request_ttft_seconds_count:rate) > 0"),
                 timeout=60, interval=0.5, what="the vLLM layer's normalised rates")
        wait_for(lambda: prom_query(stack, "min(count_over_time(up[1m])) >= 5"), timeout=90,
                 interval=0.5, what="five scrapes of every target")
        send_traffic(stack, 4)
        wait_for(lambda: prom_query(stack, 'sum(rate(vllm:time_to_first_token_seconds_count[10s])) > 0'),
                 timeout=60, interval=0.5, what="the second burst scraped")
        yield stack


def test_the_server_exposes_only_vllm_serving_names(vllm_stack):
    assert prom_query(vllm_stack, 'count(vllm:num_requests_waiting{job="vllm"})')
    assert not prom_query(vllm_stack, '{__name__=~"gpuscope_(request|region|queue|tenant)_.*"}')


def test_every_query_shows_what_the_vllm_source_feeds_and_nothing_else(vllm_stack):
    support = Support(TEST)
    problems = []
    for q in queries("prometheus"):
        key = (q.dashboard, q.panel, _target_ref(q))
        error, result = evaluate(vllm_stack, q)
        if error:
            problems.append(f"{key}: {error}")
            continue
        fed = [support.supports(source, q.expr) for source in ("vllm", "gpuscope-exporter")]
        if (True in fed or fed == [None, None]) and not result:
            if key not in ALLOWED_EMPTY and key not in MAY_BE_EMPTY:
                problems.append(f"{key}: no data, though vLLM feeds it: {q.expr}")
        elif result and "vector(0)" not in q.expr and all(
                support.reads_none_of(source, q.expr) for source in ("vllm", "gpuscope-exporter")):
            problems.append(f"{key}: data, though it reads nothing vLLM or the exporter exposes: {q.expr}")
    assert not problems, "\n".join(problems)
