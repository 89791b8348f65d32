"""The tracing part of the compose stack without its binaries: Collector, Tempo, Grafana, compose wiring.

Neither the OpenTelemetry Collector nor Tempo can be installed here (they ship as GitHub releases and
container images; no Docker engine either), and Grafana does not run. What is checked instead:

- the Collector configuration is exactly what ``gpuscope generate`` makes from the
  alert config (SLO thresholds) and the server's attribute names, and its tail-sampling policies keep
  what the SLO counts as bad, at the exact boundary the alert rules use;
- both configurations use only keys the components document for the pinned versions (the tables
  below, transcribed from the components' configuration references), and their cross-references hold
  (pipelines name defined components; ports and paths agree across Collector, Tempo, Grafana, compose);
- Grafana's Tempo datasource links to datasources that are provisioned, its LogQL parses with
  Grafana's grammar, its PromQL passes ``promtool`` and reads catalogue metrics, and nothing in it is
  eaten by Grafana's environment-variable expansion;
- where ``otelcol-contrib`` happens to be on PATH, its own ``validate`` command accepts the config.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuscope.contract import catalogue
from gpuscope.contract.profiles import PRODUCTION
from tests.conftest import require_binary
from tests.stack.test_compose import COMPOSE, ROOT, compose_config

pytest.importorskip("opentelemetry.sdk", reason="needs the tracing extra: pip install -e '.[tracing]'")

from gpuscope.otelcol import config as collector_config
from gpuscope.server import tracing

COLLECTOR = ROOT / "deploy" / "otel-collector" / "config.yaml"
TEMPO = ROOT / "deploy" / "tempo" / "tempo.yml"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources"
TEMPO_DATASOURCE = DATASOURCES / "tempo.yml"

#: The versions the key tables below were written for; bumping an image means re-checking them.
PINNED = {"otel-collector": "otel/opentelemetry-collector-contrib:0.111.0", "tempo": "grafana/tempo:2.6.1"}

# --- documented configuration keys (Collector contrib 0.111) -----------------------------------------
#: Nested dicts: a key maps to its sub-table, or to None when its value is a leaf (any scalar or list).
TLS_CLIENT = {"insecure": None, "insecure_skip_verify": None, "ca_file": None, "cert_file": None,
              "key_file": None, "server_name_override": None, "min_version": None, "max_version": None}
COLLECTOR_KEYS = {
    "receivers": {"otlp": {"protocols": {
        "grpc": {"endpoint": None, "transport": None, "max_recv_msg_size_mib": None, "tls": None,
                 "keepalive": None, "max_concurrent_streams": None, "include_metadata": None, "auth": None},
        "http": {"endpoint": None, "traces_url_path": None, "metrics_url_path": None, "logs_url_path": None,
                 "cors": None, "tls": None, "include_metadata": None, "max_request_body_size": None,
                 "auth": None},
    }}},
    "processors": {
        "memory_limiter": {"check_interval": None, "limit_mib": None, "spike_limit_mib": None,
                           "limit_percentage": None, "spike_limit_percentage": None},
        "batch": {"timeout": None, "send_batch_size": None, "send_batch_max_size": None,
                  "metadata_keys": None, "metadata_cardinality_limit": None},
        "tail_sampling": {"decision_wait": None, "num_traces": None, "expected_new_traces_per_sec": None,
                          "decision_cache": {"sampled_cache_size": None}, "policies": None},
    },
    "exporters": {"otlp": {"endpoint": None, "tls": TLS_CLIENT, "compression": None, "timeout": None,
                           "headers": None, "balancer_name": None, "auth": None, "sending_queue": None,
                           "retry_on_failure": None, "keepalive": None, "write_buffer_size": None,
                           "read_buffer_size": None, "wait_for_ready": None}},
    "extensions": {"health_check": {"endpoint": None, "path": None, "tls": None, "response_body": None,
                                    "check_collector_pipeline": None}},
    "service": {"extensions": None, "pipelines": None, "telemetry": None},
}
#: tail_sampling policy types and the keys of each one's block.
POLICY_KEYS = {
    "always_sample": None,
    "latency": {"threshold_ms", "upper_threshold_ms"},
    "numeric_attribute": {"key", "min_value", "max_value", "invert_match"},
    "probabilistic": {"hash_salt", "sampling_percentage"},
    "status_code": {"status_codes"},
    "string_attribute": {"key", "values", "enabled_regex_matching", "cache_max_size", "invert_match"},
    "boolean_attribute": {"key", "value"},
    "rate_limiting": {"spans_per_second"},
    "span_count": {"min_spans", "max_spans"},
    "trace_state": {"key", "values"},
    "ottl_condition": {"error_mode", "span", "spanevent"},
}
STATUS_CODES = {"OK", "ERROR", "UNSET"}

# --- documented configuration keys (Tempo 2.6, monolithic) -------------------------------------------
TEMPO_KEYS = {
    "target": None, "stream_over_http_enabled": None, "multitenancy_enabled": None,
    "server": {"http_listen_port": None, "grpc_listen_port": None, "http_listen_address": None,
               "grpc_listen_address": None, "log_level": None, "log_format": None},
    "distributor": {"receivers": {"otlp": {"protocols": {"grpc": {"endpoint": None},
                                                         "http": {"endpoint": None}}}},
                    "log_received_spans": None},
    "ingester": {"max_block_duration": None, "max_block_bytes": None, "trace_idle_period": None,
                 "complete_block_timeout": None},
    "compactor": {"compaction": {"block_retention": None, "compacted_block_retention": None}},
    "storage": {"trace": {"backend": None, "wal": {"path": None}, "local": {"path": None},
                          "block": None, "pool": None}},
    "usage_report": {"reporting_enabled": None},
    "query_frontend": None, "querier": None, "metrics_generator": None, "overrides": None,
    "memberlist": None, "cache": None,
}

_DURATION = re.compile(r"^\d+(ns|us|µs|ms|s|m|h)$")


def unknown_keys(config, table, path: str = "") -> list[str]:
    """Keys of ``config`` the ``table`` does not document (recursing where the table has sub-tables)."""
    if not isinstance(config, dict):
        return [f"{path or '<top>'} is not a mapping"]
    found = []
    for key, value in config.items():
        component = key.split("/", 1)[0] if path.count(".") == 0 and path in (
            "receivers", "processors", "exporters", "extensions") else key
        if component not in table:
            found.append(f"{path}.{key}".lstrip("."))
        elif table[component] is not None:
            found += unknown_keys(value, table[component], f"{path}.{key}".lstrip("."))
    return found


@pytest.fixture(scope="module")
def collector() -> dict:
    return yaml.safe_load(COLLECTOR.read_text())


@pytest.fixture(scope="module")
def resolved() -> dict:
    return yaml.safe_load(compose_config().stdout)


# --- the Collector -----------------------------------------------------------------------------------

def test_collector_config_is_what_the_generator_makes_from_the_alert_config():
    assert COLLECTOR.read_text() == collector_config.render(), "run: gpuscope generate"
    assert collector_config.outputs() == {"deploy/otel-collector/config.yaml": COLLECTOR.read_text()}


def keeps(config: dict, status: str, attributes: dict) -> bool:
    """The tail-sampling decision for a trace whose spans have ``status`` and ``attributes``, minus the
    probabilistic baseline: any matching policy keeps the trace (the processor's OR of policies)."""
    for policy in config["processors"]["tail_sampling"]["policies"]:
        kind, block = policy["type"], policy.get(policy["type"], {})
        if kind == "status_code" and status in block["status_codes"]:
            return True
        if kind == "string_attribute" and attributes.get(block["key"]) in block["values"]:
            return True
        if kind == "numeric_attribute":
            value = attributes.get(block["key"])
            if isinstance(value, int) and block["min_value"] <= value <= block["max_value"]:
                return True
    return False


def test_policies_keep_errors_and_every_request_slower_than_the_slo(collector):
    thresholds = PRODUCTION.thresholds
    objective = thresholds.slo_ttft_objective_s
    # The alert rules count a request as good when its TTFT is in the objective's bucket (le=objective):
    # the policy must keep exactly the others. The server rounds TTFT up to whole ms.
    at_objective = {tracing.OUTCOME: "length", tracing.TTFT_MS: tracing._ms(objective)}
    just_over = {tracing.OUTCOME: "length", tracing.TTFT_MS: tracing._ms(objective + 0.0004)}
    assert not keeps(collector, "UNSET", at_objective)
    assert keeps(collector, "UNSET", just_over)
    assert keeps(collector, "UNSET", {tracing.OUTCOME: "stop", tracing.TTFT_MS: 3_600_000})
    for outcome in thresholds.slo_bad_outcomes:  # what spends the availability budget
        assert keeps(collector, "UNSET", {tracing.OUTCOME: outcome})
    assert keeps(collector, "ERROR", {tracing.OUTCOME: "length", tracing.TTFT_MS: 5})
    assert not keeps(collector, "UNSET", {tracing.OUTCOME: "abort"})  # the client's choice, as in the SLO
    policies = collector["processors"]["tail_sampling"]["policies"]
    (baseline,) = [p for p in policies if p["type"] == "probabilistic"]
    assert 0 < baseline["probabilistic"]["sampling_percentage"] < 100


def test_collector_config_uses_only_documented_keys(collector):
    assert unknown_keys(collector, COLLECTOR_KEYS) == []
    sampling = collector["processors"]["tail_sampling"]
    assert _DURATION.match(sampling["decision_wait"]) and sampling["num_traces"] > 0
    assert _DURATION.match(collector["processors"]["memory_limiter"]["check_interval"])
    assert _DURATION.match(collector["processors"]["batch"]["timeout"])
    names = [p["name"] for p in sampling["policies"]]
    assert len(names) == len(set(names)), "policy names must be unique"
    for policy in sampling["policies"]:
        kind = policy["type"]
        assert kind in POLICY_KEYS, kind
        blocks = set(policy) - {"name", "type"}
        if POLICY_KEYS[kind] is None:
            assert not blocks
            continue
        assert blocks == {kind}, f"{policy['name']}: a {kind} policy takes only its {kind} block"
        assert set(policy[kind]) <= POLICY_KEYS[kind], policy
        if kind == "status_code":
            assert set(policy[kind]["status_codes"]) <= STATUS_CODES
        if kind == "numeric_attribute":
            block = policy[kind]
            assert isinstance(block["min_value"], int) and isinstance(block["max_value"], int)
            assert block["min_value"] <= block["max_value"] < 2**63


def test_collector_pipelines_name_defined_components(collector):
    # What the Collector itself checks at start-up: every component a pipeline names is defined, every
    # extension the service starts is configured, and a traces pipeline has a receiver and an exporter.
    service = collector["service"]
    assert set(service["extensions"]) <= set(collector["extensions"])
    (pipeline,) = service["pipelines"].items()
    name, parts = pipeline
    assert name == "traces" and parts["receivers"] and parts["exporters"]
    for kind in ("receivers", "processors", "exporters"):
        assert set(parts[kind]) <= set(collector[kind]), kind
    assert parts["processors"][0] == "memory_limiter", "memory_limiter must come first"
    assert parts["processors"].index("tail_sampling") < parts["processors"].index("batch")


def test_collector_binary_accepts_the_config_where_it_exists():
    binary = shutil.which("otelcol-contrib")
    if binary is None:  # never in CI: the Collector is a GitHub release / container image, not a package
        pytest.skip("otelcol-contrib is not installed (no Debian or PyPI package exists)")
    result = subprocess.run([binary, "validate", f"--config={COLLECTOR}"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Tempo ---------------------------------------------------------------------------------------

def test_tempo_config_uses_only_documented_keys_and_the_collector_reaches_it(collector):
    config = yaml.safe_load(TEMPO.read_text())
    assert unknown_keys(config, TEMPO_KEYS) == []
    assert config["storage"]["trace"]["backend"] == "local"
    receiver = config["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    (exporter,) = collector["exporters"].values()
    host, port = exporter["endpoint"].rsplit(":", 1)
    assert host == "tempo" and receiver == f"0.0.0.0:{port}" and exporter["tls"]["insecure"] is True
    assert _DURATION.match(config["compactor"]["compaction"]["block_retention"])
    assert config["usage_report"]["reporting_enabled"] is False


# --- Grafana's Tempo datasource ------------------------------------------------------------------

def grafana_expansion_leftovers(value) -> list[str]:
    """Strings Grafana's provisioning would change: it runs os.ExpandEnv on each part between ``$$``."""
    if isinstance(value, dict):
        return [bad for v in value.values() for bad in grafana_expansion_leftovers(v)]
    if isinstance(value, list):
        return [bad for v in value for bad in grafana_expansion_leftovers(v)]
    if isinstance(value, str) and any("$" in part for part in value.split("$$")):
        return [value]
    return []


def grafana_value(text: str) -> str:
    """What Grafana makes of a provisioned string that has no variables of its own: ``$$`` → ``$``."""
    return "$".join(text.split("$$"))


@pytest.fixture(scope="module")
def datasource() -> dict:
    (ds,) = yaml.safe_load(TEMPO_DATASOURCE.read_text())["datasources"]
    return ds


def test_tempo_datasource_points_at_tempo_and_links_provisioned_datasources(datasource):
    provisioned = {}
    for path in DATASOURCES.glob("*.yml"):
        for ds in yaml.safe_load(path.read_text())["datasources"]:
            assert ds["uid"] not in provisioned, f"uid {ds['uid']} provisioned twice"
            provisioned[ds["uid"]] = ds["type"]
    assert datasource["type"] == "tempo" and provisioned[datasource["uid"]] == "tempo"
    tempo = yaml.safe_load(TEMPO.read_text())
    assert datasource["url"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    data = datasource["jsonData"]
    assert provisioned[data["tracesToLogsV2"]["datasourceUid"]] == "loki"
    assert provisioned[data["tracesToMetrics"]["datasourceUid"]] == "prometheus"
    assert grafana_expansion_leftovers(datasource) == []


def test_trace_to_logs_opens_the_request_log_lines(datasource):
    from tests.dashboards.test_logql import check

    links = datasource["jsonData"]["tracesToLogsV2"]
    assert links["customQuery"] is True
    query = grafana_value(links["query"])
    # The server's Loki stream (the alert config's selector) filtered by the trace_id structured metadata.
    assert query == "{" + PRODUCTION.selectors.server_logs + '} | trace_id="${__trace.traceId}"'
    (result,) = check([query.replace("${__trace.traceId}", "4bf92f3577b34da6a3ce929d0e0e4736")])
    assert result["ok"], result


def test_trace_to_metrics_queries_are_promql_on_catalogue_metrics_of_the_spans_tenant(datasource, tmp_path):
    links = datasource["jsonData"]["tracesToMetrics"]
    assert links["tags"] == [{"key": tracing.TENANT, "value": "tenant"}]
    rules, metrics = [], {m.name: m for m in catalogue.all_metrics()}
    for i, entry in enumerate(links["queries"]):
        query = grafana_value(entry["query"])
        assert "{" + PRODUCTION.selectors.server + ", $__tags}" in query, entry
        for name in re.findall(r"\b(gpuscope_[a-z0-9_]+?)(?:_bucket)?\{", query):
            assert name in metrics and "tenant" in metrics[name].labels, name
        # Grafana puts the span's tags in place of $__tags, e.g. tenant="alpha" (nothing if it has none).
        for tags in ('tenant="alpha"', ""):
            rules.append({"record": f"gpuscope:trace_link_{i}_{len(tags)}",
                          "expr": query.replace("$__tags", tags)})
    path = tmp_path / "links.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "trace-links", "rules": rules}]}))
    result = subprocess.run([require_binary("promtool"), "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- compose -----------------------------------------------------------------------------------------

def _mounts(service: dict) -> dict[str, str]:
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        out[target] = source
    return out


def test_compose_runs_collector_and_tempo_wired_to_the_server_and_grafana(resolved, collector):
    raw = yaml.safe_load(COMPOSE.read_text())
    for name, image in PINNED.items():
        assert raw["x-versions"][name] == image, f"{name} moved: re-check the key tables above"
    services = resolved["services"]
    assert services["otel-collector"]["image"] == PINNED["otel-collector"]
    assert services["tempo"]["image"] == PINNED["tempo"]

    # The server sends to the Collector's OTLP/HTTP receiver.
    endpoint = services["server"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    http = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert endpoint == f"http://otel-collector:{http.rsplit(':', 1)[1]}"

    # The Collector reads the generated file, at the path its command names.
    otel = services["otel-collector"]
    (config_flag,) = [a for a in otel["command"] if a.startswith("--config=")]
    assert _mounts(otel)[config_flag.removeprefix("--config=")] == str(COLLECTOR)
    assert config_flag in otel["healthcheck"]["test"]

    # Tempo reads its file and keeps its blocks and WAL on the named volume.
    tempo_service = services["tempo"]
    (config_flag,) = [a for a in tempo_service["command"] if a.startswith("-config.file=")]
    mounts = _mounts(tempo_service)
    assert mounts[config_flag.removeprefix("-config.file=")] == str(TEMPO)
    assert mounts["/var/tempo"] == "tempo-data" and "tempo-data" in resolved["volumes"]
    tempo = yaml.safe_load(TEMPO.read_text())
    for path in (tempo["storage"]["trace"]["wal"]["path"], tempo["storage"]["trace"]["local"]["path"]):
        assert path.startswith("/var/tempo/"), path
    port = tempo["server"]["http_listen_port"]
    assert f"http://127.0.0.1:{port}/ready" in tempo_service["healthcheck"]["test"]

    # Neither is published on the host; Grafana reaches Tempo on the compose network.
    assert not otel.get("ports") and not tempo_service.get("ports")
    assert "tempo" in services["grafana"]["depends_on"]
    provisioning = _mounts(services["grafana"])["/etc/grafana/provisioning"]
    assert provisioning == str(ROOT / "deploy" / "grafana" / "provisioning")


def test_compose_files_of_the_tracing_services_are_the_ones_validated_here(resolved):
    validated = {str(COLLECTOR), str(TEMPO)}
    for name in ("otel-collector", "tempo"):
        for source in _mounts(resolved["services"][name]).values():
            if source.startswith("/"):
                assert source in validated, f"{name} mounts {source}, which no test here validates"
                assert Path(source).exists()
