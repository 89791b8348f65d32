"""Building blocks shared by the ``*.dashboard.py`` sources: datasources, targets, panels, layout.

Why not plain grafanalib everywhere: its ``Heatmap`` emits the legacy heatmap
fields (``dataFormat: tsbuckets``, ``yBucketBound``) that Grafana >= 9.1 has to
migrate, and its ``Target`` has no ``exemplar`` switch and takes a datasource
name, not a uid. ``Heatmap`` and ``PromTarget`` here emit the modern JSON;
timeseries, stat, table and logs panels are grafanalib's own.

Datasource uids are fixed (``gpuscope.contract.uids``) so that dashboards,
the exemplar link and alert links are portable; ``gpuscope generate`` also writes
Grafana's datasource provisioning file from ``datasources_provisioning`` below.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence
from typing import Any

import attr
from grafanalib import core as g
from grafanalib.core import Dashboard, Panel, Template, Templating, Time

from gpuscope.contract import names, parts, uids
from gpuscope.contract.catalogue import Metric
from gpuscope.contract.parts import PORTS
from gpuscope.util import promql

# --- datasources --------------------------------------------------------------------------------------

PROMETHEUS_UID = uids.PROMETHEUS_DATASOURCE
LOKI_UID = uids.LOKI_DATASOURCE
ALERTMANAGER_UID = uids.ALERTMANAGER_DATASOURCE
TEMPO_UID = uids.TEMPO_DATASOURCE
PROMETHEUS = {"type": "prometheus", "uid": PROMETHEUS_UID}
LOKI = {"type": "loki", "uid": LOKI_UID}

#: Stream selector of the reference server's logs in Loki (its LokiHandler sets service and instance).
SERVER_LOG_STREAM = f'{{service="{parts.SERVER.service}"}}'

#: LogQL that the exemplar link opens: every log line of the request whose trace id the exemplar carries.
#: ``TRACE_ID`` is replaced by Grafana's ``${__value.raw}``; tools/logql checks the LogQL with it filled in.
EXEMPLAR_LOGQL = SERVER_LOG_STREAM + ' | trace_id="TRACE_ID"'


def _explore_url(expr: str) -> str:
    """A Grafana Explore link (relative, so it works behind any root URL) running ``expr`` on Loki."""
    pane = {"datasource": LOKI_UID, "queries": [{"refId": "A", "datasource": LOKI, "expr": expr}],
            "range": {"from": "now-1h", "to": "now"}}
    return "/explore?schemaVersion=1&panes=" + urllib.parse.quote(json.dumps({"logs": pane},
                                                                              separators=(",", ":")))


def datasources_provisioning() -> dict[str, Any]:
    """Grafana's datasource provisioning file (compose service names as hosts)."""
    # Grafana expands $VAR and ${VAR} in provisioning files: $$ keeps ${__value.raw} for the link itself.
    trace_link = _explore_url(EXEMPLAR_LOGQL).replace("TRACE_ID", "$${__value.raw}")
    return {
        "apiVersion": 1,
        "datasources": [
            {"name": "Prometheus", "type": "prometheus", "uid": PROMETHEUS_UID, "access": "proxy",
             "url": f"http://prometheus:{PORTS['prometheus']}", "isDefault": True, "editable": False,
             "jsonData": {
                 "timeInterval": "5s",  # the scrape interval: $__rate_interval is computed from it
                 "httpMethod": "POST",
                 "manageAlerts": False,
                 "alertmanagerUid": ALERTMANAGER_UID,
                 # An exemplar opens the request's trace in Tempo and its log lines in Loki.
                 "exemplarTraceIdDestinations": [
                     {"name": "trace_id", "datasourceUid": TEMPO_UID, "urlDisplayLabel": "Trace in Tempo"},
                     {"name": "trace_id", "url": trace_link, "urlDisplayLabel": "Logs of this request"},
                 ],
             }},
            {"name": "Loki", "type": "loki", "uid": LOKI_UID, "access": "proxy",
             "url": f"http://loki:{PORTS['loki']}", "editable": False,
             # The trace id of a request's log line (its JSON body) opens the trace in Tempo.
             "jsonData": {"maxLines": 1000, "derivedFields": [
                 {"name": "trace_id", "matcherRegex": '"trace_id": "([0-9a-f]{32})"',
                  "datasourceUid": TEMPO_UID, "url": "$${__value.raw}",
                  "urlDisplayLabel": "Trace in Tempo"}]}},
            {"name": "Alertmanager", "type": "alertmanager", "uid": ALERTMANAGER_UID, "access": "proxy",
             "url": f"http://alertmanager:{PORTS['alertmanager']}", "editable": False,
             "jsonData": {"implementation": "prometheus", "handleGrafanaManagedAlerts": False}},
        ],
    }


# --- selectors ---------------------------------------------------------------------------------------
# Panels read only normalised series (``gpuscope.contract.names``), recorded by each source's layer, so
# every panel is the same for gpuscope, vLLM and dcgm-exporter (docs/sources.md). Rates and bucket
# rates are recorded over the rule windows: panels show them as they are, no ``rate()`` of their own.

#: Dashboard variable that filters each label.
VARIABLE_OF_LABEL = {"instance": "instance", "gpu": "gpu", "op": "op", "tenant": "tenant"}


def filtered(name: str, *labels: str, extra: str = "") -> str:
    """``name{instance=~"$instance",...}``: a normalised series filtered by ``instance`` and the
    dashboard variables of ``labels`` (``gpu``, ``op``, ``tenant``)."""
    matchers = [f'{label}=~"${VARIABLE_OF_LABEL[label]}"' for label in dict.fromkeys(("instance", *labels))]
    return promql.sel(name, *matchers, extra)


def buckets(metric: Metric, *labels: str, extra: str = "") -> str:
    """The normalised bucket rates of a histogram, filtered."""
    return filtered(names.rate(metric, "_bucket"), *labels, extra=extra)


def heatmap_expr(metric: Metric, *labels: str) -> str:
    """Bucket rates summed per ``le``: the form Grafana's heatmap reads with ``format: heatmap``."""
    assert metric.type == "histogram", metric.name
    return f"sum by (le) ({buckets(metric, *labels)})"


def quantile_expr(q: float, metric: Metric, *labels: str, by: Sequence[str] = ()) -> str:
    """The ``q``-quantile of a histogram's normalised bucket rates, filtered, per ``by``."""
    return promql.histogram_quantile(q, buckets(metric, *labels), ("le", *by))


def sum_expr(name: str, *labels: str, by: Sequence[str] = (), extra: str = "") -> str:
    """``sum by (...) (name{...})``: a normalised rate or gauge summed."""
    grouping = f"sum by ({', '.join(by)}) " if by else "sum "
    return f"{grouping}({filtered(name, *labels, extra=extra)})"


# --- targets ------------------------------------------------------------------------------------------


@attr.s
class PromTarget:
    """A Prometheus query as Grafana 10/11 stores it (datasource by uid, exemplar switch)."""

    expr: str = attr.ib()
    legendFormat: str = attr.ib(default="")
    format: str = attr.ib(default="time_series")
    exemplar: bool = attr.ib(default=False)
    instant: bool = attr.ib(default=False)
    refId: str = attr.ib(default="A")

    def to_json_data(self) -> dict[str, Any]:
        return {"datasource": PROMETHEUS, "expr": self.expr, "legendFormat": self.legendFormat,
                "format": self.format, "exemplar": self.exemplar, "instant": self.instant,
                "range": not self.instant, "refId": self.refId, "editorMode": "code"}


@attr.s
class LokiTarget:
    """A LogQL query (log lines, or a metric query over them)."""

    expr: str = attr.ib()
    legendFormat: str = attr.ib(default="")
    refId: str = attr.ib(default="A")
    queryType: str = attr.ib(default="range")

    def to_json_data(self) -> dict[str, Any]:
        return {"datasource": LOKI, "expr": self.expr, "legendFormat": self.legendFormat,
                "refId": self.refId, "queryType": self.queryType, "editorMode": "code"}


def targets(*items: PromTarget | LokiTarget) -> list[PromTarget | LokiTarget]:
    """Give each target its own refId (A, B, ...)."""
    return [attr.evolve(t, refId=chr(ord("A") + i)) for i, t in enumerate(items)]


# --- panels -------------------------------------------------------------------------------------------


@attr.s
class Heatmap(Panel):
    """Grafana's modern heatmap panel (not grafanalib's legacy one).

    With ``calculate=False`` (the default) it reads ``_bucket`` increases with
    ``format: heatmap``; with ``calculate=True`` Grafana buckets raw values
    itself (used for gauges across many series, e.g. utilization across GPUs).
    """

    unit: str = attr.ib(default="s")
    calculate: bool = attr.ib(default=False)
    scheme: str = attr.ib(default="Oranges")

    def to_json_data(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "calculate": self.calculate,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": self.scheme, "fill": "dark-orange", "scale": "exponential",
                      "exponent": 0.5, "steps": 64, "reverse": False},
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
            "yAxis": {"axisPlacement": "left", "reverse": False, "unit": self.unit},
            "cellValues": {"unit": "short"},
            "showValue": "never",
        }
        if self.calculate:
            options["calculation"] = {"xBuckets": {"mode": "size", "value": ""},
                                      "yBuckets": {"mode": "count", "value": "20",
                                                   "scale": {"type": "linear"}}}
        return self.panel_json({
            "type": "heatmap",
            "options": options,
            "fieldConfig": {"defaults": {"custom": {
                "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                "scaleDistribution": {"type": "linear"}}}, "overrides": []},
        })


def timeseries(title: str, *items: PromTarget | LokiTarget, unit: str = "short", description: str = "",
               stack: bool = False, w: int = 12, h: int = 8, **kw: Any) -> g.TimeSeries:
    extra = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 30} if stack else {}
    return g.TimeSeries(title=title, dataSource=_ds(items), targets=targets(*items), unit=unit,
                        description=description, gridPos=g.GridPos(h=h, w=w, x=0, y=0),
                        legendDisplayMode="table", legendPlacement="right" if w >= 16 else "bottom",
                        legendCalcs=["lastNotNull", "max"], tooltipMode="multi", **extra, **kw)


def stat(title: str, *items: PromTarget, unit: str = "short", description: str = "", w: int = 4,
         h: int = 4, decimals: int | None = None) -> g.Stat:
    return g.Stat(title=title, dataSource=PROMETHEUS, targets=targets(*items), format=unit,
                  description=description, gridPos=g.GridPos(h=h, w=w, x=0, y=0), reduceCalc="lastNotNull",
                  decimals=decimals, noValue="no data", graphMode="area")


def table(title: str, *items: PromTarget, description: str = "", w: int = 12, h: int = 8,
          unit: str = "", exclude: Sequence[str] = ("Time", "__name__")) -> g.Table:
    organize = {"id": "organize", "options": {"excludeByName": {name: True for name in exclude}}}
    return g.Table(title=title, dataSource=PROMETHEUS, targets=targets(*items), description=description,
                   gridPos=g.GridPos(h=h, w=w, x=0, y=0), unit=unit,
                   transformations=[{"id": "merge", "options": {}}, organize])


def heatmap(title: str, expr: str, unit: str = "s", description: str = "", w: int = 12, h: int = 8,
            calculate: bool = False, **kw: Any) -> Heatmap:
    target = PromTarget(expr, legendFormat="{{le}}" if not calculate else "{{gpu}}",
                        format="time_series" if calculate else "heatmap")
    return Heatmap(title=title, dataSource=PROMETHEUS, targets=[target], unit=unit, calculate=calculate,
                   description=description, gridPos=g.GridPos(h=h, w=w, x=0, y=0), **kw)


def logs(title: str, expr: str, description: str = "", w: int = 24, h: int = 12) -> g.Logs:
    return g.Logs(title=title, dataSource=LOKI, targets=[LokiTarget(expr)], description=description,
                  gridPos=g.GridPos(h=h, w=w, x=0, y=0), showTime=True, wrapLogMessages=True,
                  enableLogDetails=True, prettifyLogMessage=False, sortOrder="Descending")


def _ds(items: Sequence[PromTarget | LokiTarget]) -> dict[str, str]:
    return LOKI if items and isinstance(items[0], LokiTarget) else PROMETHEUS


# --- layout and dashboard -----------------------------------------------------------------------------


def flow(panels: Sequence[Panel]) -> list[Panel]:
    """Place panels left to right in their own widths, wrapping at 24 columns; ids in order."""
    placed, x, y, row_h = [], 0, 0, 0
    for i, panel in enumerate(panels, start=1):
        w, h = panel.gridPos.w, panel.gridPos.h
        if x + w > 24:
            x, y, row_h = 0, y + row_h, 0
        placed.append(attr.evolve(panel, id=i, gridPos=g.GridPos(h=h, w=w, x=x, y=y)))
        x, row_h = x + w, max(row_h, h)
    return placed


def variable(name: str, query: str, label: str) -> Template:
    """A multi-select Prometheus variable with All meaning any value (regex ``.*``)."""
    return Template(name=name, label=label, query=query, dataSource=PROMETHEUS, includeAll=True,
                    multi=True, allValue=".*", default="$__all", refresh=2, sort=1)


def instance_var() -> Template:
    """Every scraped target: servers, GPU exporters and node_exporters, whatever the source."""
    return variable("instance", "label_values(up, instance)", "Instance")


def gpu_var() -> Template:
    return variable("gpu", f"label_values({names.GPU_INFO}, gpu)", "GPU")


def op_var() -> Template:
    return variable("op", f"label_values({names.REGION_COUNT_RATE}, op)", "Op")


def tenant_var() -> Template:
    return variable("tenant", f"label_values({names.REQUESTS_RATE}, tenant)", "Tenant")


def dashboard(uid: str, title: str, description: str, panels: Sequence[Panel],
              variables: Sequence[Template], tags: Sequence[str] = ()) -> Dashboard:
    return Dashboard(
        uid=uid, title=title, description=description, tags=["gpuscope", *tags],
        panels=flow(panels), templating=Templating(list=list(variables)),
        time=Time("now-1h", "now"), refresh="10s", timezone="browser", schemaVersion=39,
        graphTooltip=1, editable=False,
        links=[g.DashboardLink(title="gpuscope", tags=["gpuscope"], asDropdown=True, type="dashboards",
                               includeVars=True, keepTime=True)],
    )
