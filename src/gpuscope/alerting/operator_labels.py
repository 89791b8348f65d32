"""The labels an operator acts on, on every alert about one GPU: which board, which model, whose workload.

Normalised GPU series keep only stable labels (``job``, ``instance``, ``gpu``): anything that changes
under a running GPU (the Kubernetes pod of its workload) would split series and break joins. Identity
and workload labels live on ``gpuscope:gpu:info`` alone, and each GPU alert joins them on at the end,
where nothing else is matched against them.
"""

from __future__ import annotations

from gpuscope.contract import names
from gpuscope.util.promql import by

#: From ``gpuscope:gpu:info``, where the source has them: the board (``uuid``; dcgm-exporter's ``UUID``),
#: its model (``name``; dcgm-exporter's ``modelName``), and in Kubernetes mode the workload's ``pod``,
#: ``namespace`` and ``container`` (who to call).
LABELS = ("uuid", "name", "pod", "namespace", "container")
#: Annotation text naming the workload, where the alert has one.
WORKLOAD = ("{{ with $labels.pod }} (workload {{ $labels.namespace }}/{{ . }}"
            "{{ with $labels.container }}, container {{ . }}{{ end }}){{ end }}")


def joined(expr: str) -> str:
    """``expr`` (keyed by job, instance, gpu) with ``LABELS`` of its GPU, or unchanged where the GPU has
    no info series: the join never drops an alert. One info series per GPU is taken (a GPU time-sliced
    between pods, which dcgm-exporter writes once per pod, names one of them)."""
    key = "on (job, instance, gpu)"
    return (f"(\n{expr}\n)\n* {key} group_left ({by(LABELS)})\n"
            f"topk by (job, instance, gpu) (1, {names.GPU_INFO})\nor {key}\n(\n{expr}\n)")
