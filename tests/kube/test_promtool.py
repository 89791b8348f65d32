"""The PrometheusRule, the adapter's queries and the Alertmanager Secret, checked by Prometheus'
and Alertmanager's own tools (Debian's prometheus and prometheus-alertmanager packages).

The adapter's ``metricsQuery`` templates are expanded the way prometheus-adapter fills them for the
HPA's two metrics (``<<.LabelMatchers>>``: the object's namespace and name, or the pods' names;
``<<.GroupBy>>``: the resource's label), then evaluated by ``promtool test rules`` on series shaped
like the ones the ServiceMonitors produce.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gpuscope.alerting.generate import prometheus_rules_path, sources_rules_path
from gpuscope.contract import names
from gpuscope.contract.profiles import PRODUCTION
from gpuscope.kube.config import DEPLOYMENT
from tests.conftest import require_binary
from tests.kube.conftest import ROOT, find

pytestmark = pytest.mark.distro
NS, SERVICE = DEPLOYMENT.cluster.namespace, DEPLOYMENT.names.server


def _run(args: list[str], cwd: Path) -> None:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _adapter_rules() -> dict[str, dict]:
    cm = find("gpu", "ConfigMap", DEPLOYMENT.names.adapter_config)
    return {r["name"]["as"]: r for r in yaml.safe_load(cm["data"]["config.yaml"])["rules"]}


def expand(template: str, matchers: str, group_by: str) -> str:
    """prometheus-adapter's metricsQuery template, filled in (its fields use << >> delimiters)."""
    out = template.replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", group_by)
    assert "<<" not in out and ">>" not in out, out
    return out


def test_prometheus_rule_passes_promtool_check_rules(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    rule = find("gpu", "PrometheusRule", DEPLOYMENT.names.prometheus_rule)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    _run([promtool, "check", "rules", "rules.yml"], tmp_path)


def test_adapter_queries_are_valid_promql(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    rules = []
    for i, rule in enumerate(_adapter_rules().values()):
        rules.append({"record": f"adapter:series_{i}", "expr": f"count({rule['seriesQuery']})"})
        rules.append({"record": f"adapter:metric_{i}",
                      "expr": expand(rule["metricsQuery"], f'namespace="{NS}",pod=~"a|b"', "pod")})
    (tmp_path / "adapter.yml").write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": rules}]}))
    _run([promtool, "check", "rules", "adapter.yml"], tmp_path)


def test_ttft_query_is_the_recording_rules_quantile() -> None:
    """The adapter's query is the p99 record with the gpuscope server's bucket and count rates in line."""
    groups = [g for path in (sources_rules_path(PRODUCTION), prometheus_rules_path(PRODUCTION))
              for g in yaml.safe_load((ROOT / path).read_text())["groups"]]
    recorded = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    p99 = recorded[names.TTFT_P99]
    for rate in (names.TTFT_BUCKET_RATE, names.TTFT_COUNT_RATE):
        p99 = p99.replace(rate, recorded[rate])
    q = DEPLOYMENT.autoscaling.ttft_quantile
    same = (p99.replace("histogram_quantile(0.99,", f"histogram_quantile({q:g},")
               .replace("job, instance", "<<.GroupBy>>")
               .replace(f"{{{PRODUCTION.selectors.server}}}",
                        f"{{{PRODUCTION.selectors.server},<<.LabelMatchers>>}}"))
    assert same.strip() in _adapter_rules()[DEPLOYMENT.autoscaling.ttft_metric]["metricsQuery"]


def _bucket_series(job: str, service: str, pod: str, per_minute: dict[str, int],
                   flat: bool = False) -> list[dict]:
    out = []
    for le, n in per_minute.items():
        name = "gpuscope_request_ttft_seconds_" + ("count" if le == "count" else "bucket")
        labels = f'job="{job}",namespace="{NS}",service="{service}",pod="{pod}",instance="{pod}:8000"'
        if le != "count":
            labels += f',le="{le}"'
        out.append({"series": f"{name}{{{labels}}}", "values": "100+0x20" if flat else f"0+{n}x20"})
    return out


def test_adapter_metrics_evaluate_to_what_the_hpa_should_see(tmp_path: Path) -> None:
    promtool = require_binary("promtool")
    rules = _adapter_rules()
    a = DEPLOYMENT.autoscaling
    ttft = expand(rules[a.ttft_metric]["metricsQuery"], f'namespace="{NS}",service="{SERVICE}"', "service")
    pods = '"gpuscope-server-a|gpuscope-server-b"'
    busy = expand(rules[a.gpu_busy_metric]["metricsQuery"], f"namespace=\"{NS}\",pod=~{pods}", "pod")
    # Two pods behind the Service; each minute 50 requests on each: 25 ≤ 0.5 s, 45 ≤ 1 s, all ≤ 2.5 s.
    # Together: 50 / 90 / 100 of 100, so p95 lies in (1, 2.5]: 1 + 1.5 × (95 − 90) / (100 − 90) = 1.75 s.
    shape = {"0.5": 25, "1.0": 45, "2.5": 50, "+Inf": 50, "count": 50}
    busy_series = []
    for pod, gpu, value in (("gpuscope-server-a", "0", 0.9), ("gpuscope-server-a", "1", 0.5),
                            ("gpuscope-server-b", "2", 0.3)):
        busy_series.append({"series": f'gpuscope_gpu_utilization_ratio{{job="gpuscope-exporter",gpu="{gpu}",'
                                      f'namespace="{NS}",pod="{pod}",container="server",host="node-1"}}',
                            "values": f"{value}x20"})
    # Not the server's: another namespace's pod of the same name, and a GPU no pod holds.
    busy_series.append({"series": 'gpuscope_gpu_utilization_ratio{job="gpuscope-exporter",gpu="3",'
                                  'namespace="elsewhere",pod="gpuscope-server-a",container="x"}',
                        "values": "1x20"})
    busy_series.append({"series": 'gpuscope_gpu_utilization_ratio{job="gpuscope-exporter",gpu="4"}',
                        "values": "1x20"})
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {"name": "busy service", "interval": "1m",
             "input_series": [*_bucket_series("gpuscope-server", SERVICE, "gpuscope-server-a", shape),
                              *_bucket_series("gpuscope-server", SERVICE, "gpuscope-server-b", shape),
                              # another job's histogram of the same name is not the server's
                              *_bucket_series("other", SERVICE, "gpuscope-server-c", {"+Inf": 5, "count": 5}),
                              *busy_series],
             "promql_expr_test": [
                 # rate() over extrapolated windows leaves float noise (1.7499999999999991): round it
                 {"expr": f"round({ttft}, 0.001)", "eval_time": "10m",
                  "exp_samples": [{"labels": f'{{service="{SERVICE}"}}', "value": 1.75}]},
                 {"expr": busy, "eval_time": "10m",
                  "exp_samples": [{"labels": '{pod="gpuscope-server-a"}', "value": 0.9},
                                  {"labels": '{pod="gpuscope-server-b"}', "value": 0.3}]},
             ]},
            {"name": "idle service reads 0, so the HPA may scale down", "interval": "1m",
             "input_series": _bucket_series("gpuscope-server", SERVICE, "gpuscope-server-a", shape,
                                            flat=True),
             "promql_expr_test": [
                 {"expr": ttft, "eval_time": "10m",
                  "exp_samples": [{"labels": f'{{service="{SERVICE}"}}', "value": 0}]},
             ]},
        ],
    }
    (tmp_path / "adapter.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False, width=10_000))
    _run([promtool, "test", "rules", "adapter.test.yml"], tmp_path)


def test_alertmanager_secret_passes_amtool_check_config(tmp_path: Path) -> None:
    amtool = require_binary("amtool")
    secret = find("gpu", "Secret", DEPLOYMENT.names.alertmanager_secret)
    (tmp_path / "alertmanager.yaml").write_text(secret["stringData"]["alertmanager.yaml"])
    _run([amtool, "check-config", "alertmanager.yaml"], tmp_path)
