"""The Kubernetes workload a GPU serves, as the GPU exporters label it, kept off the normalised series.

dcgm-exporter's Kubernetes mode and the bundle's exporter (pod attribution) both add the workload's
``pod``, ``namespace`` and ``container`` to per-GPU series. They change when the workload's pod is
replaced, and the old pod's series stays inside every range window for that long: a normalised series
that kept them would split in two and break every join on ``(job, instance, gpu)``. A ServiceMonitor
with ``honorLabels: false`` (kube-prometheus-stack's default) renames them ``exported_*`` and writes the
exporter's own pod in their place. So normalised series drop all six (``DROP``), and only
``gpuscope:gpu:info`` carries the workload, under its own names (``with_workload``).
"""

from __future__ import annotations

from gpuscope.contract import upstream as up
from gpuscope.util.promql import by

LABELS = up.DCGM_KUBERNETES_LABELS
EXPORTED = tuple(f"exported_{label}" for label in LABELS)
DROP = (*LABELS, *EXPORTED)


def named(expr: str) -> str:
    """The workload's labels as ``pod`` / ``namespace`` / ``container``, however the scrape wrote them."""
    for label in LABELS:
        expr = f'label_replace({expr}, "{label}", "$1", "exported_{label}", "(.+)")'
    return expr


def per_gpu(expr: str, s: str, drop: tuple[str, ...] = ()) -> str:
    """One series per GPU (and workload) of ``expr``, with the workload's labels where it has one.

    With ``honorLabels: false`` a GPU without a workload carries the exporter's own pod labels: those
    are the ones ``up`` of the same target has, so they are removed (the GPU keeps its series)."""
    mapped = f"group without ({by((*drop, *EXPORTED))}) (\n  {named(expr)}\n)"
    kube = by(LABELS)
    return (f"(\n{mapped}\n) unless on (job, instance, {kube}) up{{{s}}}\n"
            f"or on (job, instance, gpu)\ngroup without ({kube}) (\n{mapped}\n)")


def with_workload(info: str, workloads: str) -> str:
    """``info`` (one series per GPU) with the workload labels of ``workloads`` (``per_gpu``), one per GPU;
    as it is where ``workloads`` has none for that GPU."""
    key = "on (job, instance, gpu)"
    return (f"{info}\n* {key} group_left ({by(LABELS)})\ntopk by (job, instance, gpu) (1, {workloads})\n"
            f"or {key}\n{info}")
