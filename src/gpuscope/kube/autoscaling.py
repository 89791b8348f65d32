"""The server's HorizontalPodAutoscaler and the prometheus-adapter rules that feed it.

Two metrics, and the HPA scales to the larger count either asks for:

- ``gpuscope_request_ttft_seconds_p95`` (an Object metric of the server's Service): p95 TTFT over
  the alert config's latency window, built by the same ``quantile_expr`` as the recording rules
  ``gpuscope:request_ttft_seconds:p50/p99`` from the same histogram and job selector, against the
  SLO's TTFT objective (``slo_ttft_objective_s``). The recording rules keep only ``job`` and
  ``instance``, which the adapter cannot map to a Kubernetes object, so the adapter evaluates the
  expression itself, grouped by the Service. With no traffic the quantile is absent (the rules'
  guard against NaN); the adapter answers 0 then, so an idle server can scale down (the HPA never
  scales down while a metric is missing).
- ``gpuscope_gpu_busy_ratio`` (a Pods metric): per server pod, its busiest GPU's utilization
  averaged over ``gpu_busy_window_s``: the recording rule ``gpuscope:host_gpu_busy:ratio`` takes the
  busiest GPU per host from the same exporter series; here the exporter's pod attribution puts them
  on the pod holding the GPU.

``behavior`` sets stabilization windows and rate limits in both directions against flapping.
"""

from __future__ import annotations

from gpuscope.alerting.latency import quantile_expr
from gpuscope.contract import catalogue as m
from gpuscope.contract.profiles import Profile
from gpuscope.kube.config import Deployment
from gpuscope.util.promql import duration, sel

#: prometheus-adapter's template fields (Go templates with << >> delimiters).
GROUP_BY = "<<.GroupBy>>"
LABEL_MATCHERS = "<<.LabelMatchers>>"


def ttft_query(p: Profile, d: Deployment) -> str:
    selector = f"{p.selectors.server},{LABEL_MATCHERS}"
    window = duration(p.windows.latency)
    count = sel(m.REQUEST_TTFT.series("_count"), selector)
    quantile = quantile_expr(m.REQUEST_TTFT, d.autoscaling.ttft_quantile, [GROUP_BY], selector,
                             p.windows.latency)
    return (f"(\n{quantile}\n)\nor on ({GROUP_BY})\n"
            f"0 * sum by ({GROUP_BY}) (rate({count}[{window}]))")


def gpu_busy_query(p: Profile, d: Deployment) -> str:
    selector = f"{p.selectors.exporter},{LABEL_MATCHERS}"
    window = duration(d.autoscaling.gpu_busy_window_s)
    return f"max by ({GROUP_BY}) (avg_over_time({sel(m.GPU_UTILIZATION.name, selector)}[{window}]))"


def _overrides(*labels: str) -> dict:
    return {"overrides": {label: {"resource": label} for label in labels}}


def adapter_config(p: Profile, d: Deployment) -> dict:
    """prometheus-adapter's configuration file (``--config``; its Helm chart's ``rules.existing``)."""
    a = d.autoscaling
    ttft_count = m.REQUEST_TTFT.series("_count")
    util = m.GPU_UTILIZATION.name
    return {"rules": [
        {"seriesQuery": sel(ttft_count, p.selectors.server, 'namespace!=""', 'service!=""'),
         "resources": _overrides("namespace", "service"),
         "name": {"matches": f"^{ttft_count}$", "as": a.ttft_metric},
         "metricsQuery": ttft_query(p, d)},
        {"seriesQuery": sel(util, p.selectors.exporter, 'namespace!=""', 'pod!=""'),
         "resources": _overrides("namespace", "pod"),
         "name": {"matches": f"^{util}$", "as": a.gpu_busy_metric},
         "metricsQuery": gpu_busy_query(p, d)},
    ]}


def adapter_configmap(p: Profile, d: Deployment, dump) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": d.names.adapter_config, "labels": {"app.kubernetes.io/part-of": "gpuscope"}},
            "data": {"config.yaml": dump(adapter_config(p, d))}}


def _quantity(value: float) -> str:
    """A Kubernetes quantity: whole numbers as is, fractions in milli-units (0.8 → ``800m``)."""
    if float(value).is_integer():
        return str(int(value))
    milli = round(value * 1000)
    if abs(milli - value * 1000) > 1e-9:
        raise ValueError(f"{value} is not a whole number of milli-units")
    return f"{milli}m"


def hpa(p: Profile, d: Deployment) -> dict:
    a, n = d.autoscaling, d.names
    policy = {"type": "Pods"}
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": n.hpa, "labels": {"app.kubernetes.io/part-of": "gpuscope"}},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": n.server},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [
                {"type": "Object", "object": {
                    "describedObject": {"apiVersion": "v1", "kind": "Service", "name": n.server},
                    "metric": {"name": a.ttft_metric},
                    "target": {"type": "Value", "value": _quantity(p.thresholds.slo_ttft_objective_s)}}},
                {"type": "Pods", "pods": {
                    "metric": {"name": a.gpu_busy_metric},
                    "target": {"type": "AverageValue", "averageValue": _quantity(a.gpu_busy_target)}}},
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_s, "selectPolicy": "Max",
                            "policies": [{**policy, "value": a.scale_up_pods,
                                          "periodSeconds": a.scale_up_period_s}]},
                "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_s,
                              "selectPolicy": "Max",
                              "policies": [{**policy, "value": a.scale_down_pods,
                                            "periodSeconds": a.scale_down_period_s}]},
            },
        },
    }


def without_gpu_metric(p: Profile, d: Deployment) -> list[dict]:
    """A JSON patch taking the GPU metric out of the HPA (the CPU demo has no GPUs to measure)."""
    metrics = hpa(p, d)["spec"]["metrics"]
    index = next(i for i, metric in enumerate(metrics) if metric["type"] == "Pods")
    path = f"/spec/metrics/{index}"
    return [{"op": "test", "path": f"{path}/pods/metric/name", "value": d.autoscaling.gpu_busy_metric},
            {"op": "remove", "path": path}]


__all__ = ["adapter_config", "adapter_configmap", "gpu_busy_query", "hpa", "ttft_query",
           "without_gpu_metric"]
