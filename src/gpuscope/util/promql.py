"""PromQL as the generators and ``gpuscope diagnose`` write it: durations, numbers, selectors, the
``host`` join key and histogram quantiles, in one form wherever a query is built.

The alert rules (``gpuscope.alerting``), the dashboards (``gpuscope.dashboards``), the Kubernetes
objects (``gpuscope.kube``) and ``gpuscope diagnose --prometheus`` build their expressions from these,
so a query diagnose asks reads the series the way the rules that recorded them do.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.utils import floatToGoString


def duration(seconds: int) -> str:
    """Seconds → the largest whole Prometheus unit (``3600`` → ``1h``, ``90`` → ``90s``)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def num(value: float) -> str:
    """A number as PromQL and people read it (``14.4``, ``0.001``, ``3``)."""
    return f"{value:g}"


def le(bound: float) -> str:
    """A bucket's ``le`` label as prometheus_client writes it (``1.0``, ``0.25``)."""
    return floatToGoString(bound)


def sel(name: str, *matchers: str) -> str:
    """``name{m1,m2}`` from non-empty matchers."""
    return f"{name}{{{','.join(m for m in matchers if m)}}}"


def by(labels: Sequence[str]) -> str:
    return ", ".join(labels)


def histogram_quantile(q: float, buckets: str, labels: Sequence[str] = ()) -> str:
    """The ``q``-quantile of a histogram's bucket rates (or increases) ``buckets``, per ``labels``:
    the buckets summed by ``labels`` and ``le`` (last, unless ``labels`` places it), the quantile
    interpolated within the bucket that holds it, as Prometheus does."""
    grouping = labels if "le" in labels else (*labels, "le")
    return f"histogram_quantile({num(q)}, sum by ({by(grouping)}) ({buckets}))"


#: The host part of an ``instance`` (its port stripped).
HOST_REGEX = "(.*):[0-9]+"


def with_host(expr_of: str) -> str:
    """``expr_of`` with ``@M`` standing for extra matchers, keyed by ``host``: the label where the scrape
    sets one (compose must: its services have different host names), else the host part of
    ``instance``, which is right whenever an exporter runs on the machine it describes."""
    plain = expr_of.replace("{@M}", '{host=""}').replace("@M", ',host=""')
    labelled = expr_of.replace("{@M}", '{host!=""}').replace("@M", ',host!=""')
    return f'label_replace({plain}, "host", "$1", "instance", "{HOST_REGEX}")\nor\n{labelled}'
