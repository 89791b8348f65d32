"""Every PromQL query of every dashboard panel, evaluated against the live no-Docker stack.

Grafana cannot run here, so this does what Grafana would: substitute ``$__rate_interval``,
``$__interval``, ``$__range`` and the variables (at "All"), send each query to the real
Prometheus scraping the real server, exporter, node_exporter and receiver, and require data.
"""

from __future__ import annotations

import re
import time

import pytest
import requests

from gpuscope.contract import catalogue
from gpuscope.dashboards import common
from tests.conftest import wait_for
from tests.dashboards.conftest import SCRAPE_INTERVAL_S
from tests.dashboards.no_data_allowlist import ALLOWED_EMPTY, ALLOWED_EMPTY_VARIABLES, MAY_BE_EMPTY
from tests.dashboards.panels import Query, dashboards, queries, substitute

pytestmark = [pytest.mark.slow, pytest.mark.distro]

# What Grafana computes at a 5 s step with the datasource's 5 s scrape interval:
# $__interval = step; $__rate_interval = max($__interval + scrape interval, 4 × scrape interval).
STEP_S = SCRAPE_INTERVAL_S
RATE_INTERVAL = f"{max(STEP_S + SCRAPE_INTERVAL_S, 4 * SCRAPE_INTERVAL_S)}s"


def _target_ref(q: Query) -> str:
    dash = dashboards()[q.dashboard]
    for panel in dash["panels"]:
        if panel["title"] == q.panel:
            for target in panel["targets"]:
                if target["expr"] == q.expr:
                    return target["refId"]
    raise AssertionError(q)


def evaluate(stack, q: Query) -> tuple[str | None, list]:
    """(error or None, result) of one dashboard query over the stack's lifetime."""
    end = time.time()
    start = stack.started_at
    expr = substitute(q.expr, RATE_INTERVAL, f"{STEP_S}s", f"{int(end - start) + 1}s")
    url = stack.url("prometheus") + "/api/v1/" + ("query" if q.instant else "query_range")
    params = {"query": expr, "time": end} if q.instant else \
        {"query": expr, "start": start, "end": end, "step": STEP_S}
    body = requests.post(url, data=params, timeout=30).json()
    if body["status"] != "success":
        return f"{body.get('errorType')}: {body.get('error')} in {expr}", []
    return None, body["data"]["result"]


def query_problems(stack) -> tuple[list[str], list[str]]:
    """Every dashboard query against ``stack``: (queries that fail or return no data though they
    should, allow-listed ones that return data now). A request that fails is a problem too: callers
    that may ask again do so while there are problems."""
    problems, stale = [], []
    for q in queries("prometheus"):
        key = (q.dashboard, q.panel, _target_ref(q))
        try:
            error, result = evaluate(stack, q)
        except (requests.RequestException, ValueError) as exc:
            error, result = f"{type(exc).__name__}: {exc}", []
        if error:
            problems.append(f"{key}: {error}")
        elif not result and key not in ALLOWED_EMPTY and key not in MAY_BE_EMPTY:
            problems.append(f"{key}: no data for {q.expr}")
        elif result and key in ALLOWED_EMPTY:
            stale.append(f"{key}: returns data now; remove it from no_data_allowlist.py")
    return problems, stale


def test_every_promql_query_parses_and_returns_data(live_stack):
    assert len(queries("prometheus")) > 80
    problems, stale = query_problems(live_stack)
    assert not problems, "\n".join(problems)
    assert not stale, "\n".join(stale)


def test_allow_list_names_real_queries():
    keys = {(q.dashboard, q.panel, _target_ref(q)) for q in queries("prometheus")}
    unknown = (set(ALLOWED_EMPTY) | set(MAY_BE_EMPTY)) - keys
    assert not unknown, f"allow-list entries that match no query: {sorted(unknown)}"


def test_variable_queries_return_values(live_stack):
    for uid, dash in dashboards().items():
        for var in dash["templating"]["list"]:
            match = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"])
            assert match, f"{uid}: variable {var['name']} query {var['query']!r} is not label_values(...)"
            selector, label = match.groups()
            r = requests.get(f"{live_stack.url('prometheus')}/api/v1/label/{label}/values",
                             params={"match[]": selector, "start": live_stack.started_at}, timeout=30)
            values = r.json()["data"]
            if var["name"] in ALLOWED_EMPTY_VARIABLES:
                assert not values, f"{var['name']} has values now; drop it from ALLOWED_EMPTY_VARIABLES"
            else:
                assert values, f"{uid}: variable {var['name']} has no values ({var['query']})"


def test_exemplar_trace_ids_lead_to_the_requests_logs(live_stack, loki_sink):
    """A heatmap cell's exemplar (trace_id in Prometheus) finds that request's log line in Loki.

    Loki itself cannot run here: the server pushes to a sink speaking Loki's push format, and the
    test checks that the stream labels and structured metadata match what the exemplar link's LogQL
    (gpuscope.dashboards.common.EXEMPLAR_LOGQL) and the logs dashboard select on.
    """
    r = requests.post(live_stack.url("prometheus") + "/api/v1/query_exemplars",
                      data={"query": catalogue.REQUEST_TTFT.series("_bucket"),
                            "start": live_stack.started_at, "end": time.time()}, timeout=30)
    exemplar_ids = {e["labels"]["trace_id"] for series in r.json()["data"] for e in series["exemplars"]}
    assert exemplar_ids, "no exemplars on the TTFT histogram"
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in exemplar_ids)

    selector = dict(re.findall(r'(\w+)="([^"]*)"', common.SERVER_LOG_STREAM))

    def logged_ids() -> set[str]:
        with loki_sink.lock:
            return {meta.get("trace_id") for labels, _, meta in loki_sink.entries
                    if selector.items() <= labels.items()}

    wait_for(lambda: exemplar_ids <= logged_ids(), timeout=30, interval=0.2,
             what="a log line in the server's stream for every exemplar's trace_id")
    with loki_sink.lock:
        metas = [meta for labels, _, meta in loki_sink.entries if selector.items() <= labels.items()]
    # The logs dashboard filters on these structured-metadata fields.
    assert all("level" in meta for meta in metas), metas[:3]
    request_lines = [meta for meta in metas if meta.get("trace_id") in exemplar_ids]
    assert all("tenant" in meta for meta in request_lines), request_lines[:3]
    assert {meta["tenant"] for meta in metas if "tenant" in meta} >= {"alpha", "beta"}
