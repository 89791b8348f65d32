"""A past window judged from Prometheus: the recording rules' series over ``--since``, per host.

Reads only normalised and derived series (``contract/names.py``: whatever the sources), plus
node_exporter's CPU for the whole-host figure. Series are keyed by ``host`` as the bottleneck rules
key them (``util/promql.py``'s ``with_host``: a ``host`` label the scrape sets, else the host part
of ``instance``), so CPU, GPUs and the server of one machine meet in one :class:`Summary`.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from gpuscope.contract import names
from gpuscope.contract.profiles import PRODUCTION
from gpuscope.diagnose.summary import GpuSummary, OpSummary, ServerSummary, Summary
from gpuscope.util.promql import duration, histogram_quantile, with_host


class HistoryError(Exception):
    """Prometheus could not be asked (unreachable, or it refused a query)."""


Query = Callable[[str], list[dict]]


def prometheus_query(url: str, at: float, timeout: float = 10.0) -> Query:
    """An instant-query function against Prometheus' HTTP API at time ``at``."""
    def query(expr: str) -> list[dict]:
        body = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"}).encode()
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/api/v1/query", data=body, timeout=timeout) as r:
                answer = json.load(r)
        except urllib.error.HTTPError as exc:  # 400/422: Prometheus names what is wrong in its body
            try:
                detail = json.load(exc).get("error", "")
            except ValueError:
                detail = ""
            raise HistoryError(f"Prometheus refused a query ({exc.code}): {detail}") from None
        except (OSError, ValueError) as exc:
            raise HistoryError(f"Prometheus at {url} not reachable: {exc}") from None
        if answer.get("status") != "success":
            raise HistoryError(f"Prometheus query failed: {answer.get('error', answer)}")
        return answer["data"]["result"]
    return query


def _values(query: Query, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
    out = {}
    for row in query(expr):
        value = float(row["value"][1])
        if math.isfinite(value):  # NaN: a quantile without observations; ±Inf: a ratio over nothing
            out[tuple(row["metric"].get(label, "") for label in labels)] = value
    return out


def judge_window(query: Query, since_s: int, host: str | None = None) -> list[Summary]:
    """One Summary per host with data in the window (only ``host`` when given)."""
    w = duration(since_s)
    node = PRODUCTION.selectors.node

    def per(expr: str, agg: str, *labels: str) -> dict[tuple[str, ...], float]:
        return _values(query, f"{agg} by (host{''.join(', ' + x for x in labels)}) (\n{with_host(expr)}\n)",
                       "host", *labels)

    def hq(q: float, bucket_rate: str, *labels: str) -> dict[tuple[str, ...], float]:
        inner = with_host(f"avg_over_time({bucket_rate}{{@M}}[{w}])")
        return _values(query, histogram_quantile(q, f"\n{inner}\n", ("host", *labels)), "host", *labels)

    cpu = per(f'1 - rate(node_cpu_seconds_total{{{node},mode="idle"@M}}[{w}])', "avg")
    core = per(f"avg_over_time({names.HOST_CPU_BUSY}{{@M}}[{w}])", "max")
    ram = per(f"max_over_time({names.HOST_RAM_USED}{{@M}}[{w}])", "max")
    g = {
        "util_mean": per(f"avg_over_time({names.GPU_UTILIZATION}{{@M}}[{w}])", "max", "gpu"),
        "util_min": per(f"min_over_time({names.GPU_UTILIZATION}{{@M}}[{w}])", "max", "gpu"),
        "util_max": per(f"max_over_time({names.GPU_UTILIZATION}{{@M}}[{w}])", "max", "gpu"),
        "memory_used_ratio": per(f"max_over_time(({names.GPU_MEMORY_USED}{{@M}} / "
                                 f"{names.GPU_MEMORY_TOTAL}{{@M}})[{w}:])", "max", "gpu"),
        "memory_growth_bytes_per_s": per(f"max_over_time({names.GPU_MEMORY_GROWTH_RATE}{{@M}}[{w}])",
                                         "max", "gpu"),
        "sm_clock_hz": per(f"avg_over_time({names.GPU_SM_CLOCK}{{@M}}[{w}])", "max", "gpu"),
        "power_w": per(f"avg_over_time({names.GPU_POWER}{{@M}}[{w}])", "max", "gpu"),
        "power_limit_w": per(f"max_over_time({names.GPU_POWER_LIMIT}{{@M}}[{w}])", "max", "gpu"),
    }
    events = per(f"avg_over_time({names.GPU_CLOCK_EVENT_RATIO}{{@M}}[{w}])", "max", "gpu", "reason")
    xids = per(f"max_over_time({names.GPU_XID_RECENT}{{@M}}[{w}])", "max", "gpu", "xid")
    srv = {
        "running": per(f"avg_over_time({names.REQUESTS_RUNNING}{{@M}}[{w}])", "sum"),
        "waiting": per(f"avg_over_time({names.QUEUE_DEPTH}{{@M}}[{w}])", "sum"),
        "kv_cache_max": per(f"max_over_time({names.KV_CACHE_USAGE}{{@M}}[{w}])", "max"),
        "preemptions": {k: v * since_s for k, v in
                        per(f"avg_over_time({names.PREEMPTIONS_RATE}{{@M}}[{w}])", "sum").items()},
        "tokens_per_s": per(f"avg_over_time({names.GENERATION_TOKENS_RATE}{{@M}}[{w}])", "sum"),
        "memory_growth_bytes_per_s": per(f"max_over_time({names.MEMORY_GROWTH_RATE}{{@M}}[{w}])", "max"),
        "ttft_p50_s": hq(0.5, names.TTFT_BUCKET_RATE), "ttft_p99_s": hq(0.99, names.TTFT_BUCKET_RATE),
        "itl_p50_s": hq(0.5, names.ITL_BUCKET_RATE), "itl_p99_s": hq(0.99, names.ITL_BUCKET_RATE),
        "queue_p50_s": hq(0.5, names.QUEUE_BUCKET_RATE),
    }
    op_p50 = hq(0.5, names.REGION_BUCKET_RATE, "op")
    op_busy = per(f"avg_over_time({names.REGION_GPU_BUSY_RATIO}{{@M}}[{w}])", "max", "op")

    hosts = {k[0] for table in (cpu, core, ram, *g.values(), *srv.values()) for k in table}
    if host is not None:
        hosts &= {host}
    out = []
    for h in sorted(hosts):
        s = Summary("prometheus", float(since_s), host=h, cpu=cpu.get((h,)), cpu_busiest_core=core.get((h,)),
                    ram_used_ratio=ram.get((h,)))
        gpus = sorted({k[1] for table in g.values() for k in table if k[0] == h}, key=lambda x: (len(x), x))
        for label in gpus:
            gs = GpuSummary(label, **{field: table.get((h, label)) for field, table in g.items()})
            gs.clock_events = {k[2]: round(v, 4) for k, v in events.items() if k[:2] == (h, label)}
            gs.xids = {k[2]: 1.0 for k, v in xids.items() if k[:2] == (h, label) and v > 0}
            if gs.memory_growth_bytes_per_s is not None and gs.memory_growth_bytes_per_s <= 0:
                gs.memory_growth_bytes_per_s = None
            s.gpus.append(gs)
        if any((h,) in table for table in srv.values()) or any(k[0] == h for k in op_p50):
            ss = ServerSummary("prometheus", **{field: table.get((h,)) for field, table in srv.items()})
            if ss.memory_growth_bytes_per_s is not None and ss.memory_growth_bytes_per_s <= 0:
                ss.memory_growth_bytes_per_s = None
            for op in sorted({k[1] for k in (*op_p50, *op_busy) if k[0] == h}):
                ss.ops[op] = OpSummary(op_p50.get((h, op)), op_busy.get((h, op)))
            s.server = ss
        else:
            s.unavailable.append("server metrics (no server series for this host in the window)")
        if not gpus:
            s.unavailable.append("GPUs (no GPU series for this host in the window)")
        out.append(s)
    return out

