"""Each source's normalisation layer against the exposition it reads (tests/fixtures/sources/).

The fixtures are vLLM's and dcgm-exporter's /metrics as those programs write them (each names the
upstream file and version it follows). The layers may read only series, and rely only on labels, that
the fixtures hold; the upstream definitions (names, types, labels, buckets) must be the fixtures'.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuscope.alerting import dcgm, sources
from gpuscope.contract import catalogue, upstream
from gpuscope.contract.profiles import PROFILES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sources"
FIXTURES_OF = {"vllm": ("vllm-0.12.prom", "vllm-0.10.prom"),
               "dcgm-exporter": ("dcgm-exporter-3.3.prom", "dcgm-exporter-4.x.prom",
                                 "dcgm-exporter-4.x-mig.prom")}
#: The exposition of the current version of each source (what a fresh install exposes).
CURRENT = {"vllm": "vllm-0.12.prom", "dcgm-exporter": "dcgm-exporter-4.x.prom"}
SELECTOR = re.compile(r'(?<![\w:])([A-Za-z_][\w:]*)(?=\{)|__name__=~"([^"]+)"')


def families(name: str) -> dict[str, object]:
    text = (FIXTURES / name).read_text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(name: str) -> dict[str, list[dict[str, str]]]:
    """Series name, as Prometheus stores it, → the label sets it is exposed with. (The parser names a
    counter's samples with ``_total`` even where the text has none, as dcgm-exporter's counters.)"""
    text = (FIXTURES / name).read_text()
    written = set(re.findall(r"^([A-Za-z_:][\w:]*)[{ ]", text, re.M))
    out: dict[str, list[dict[str, str]]] = {}
    for family in families(name).values():
        for sample in family.samples:
            series = sample.name if sample.name in written else sample.name.removesuffix("_total")
            out.setdefault(series, []).append(sample.labels)
    return out


def read_by(source: sources.Source) -> set[str]:
    """Every series name the source's layers (both profiles) select, ``up`` and the layer's own records
    (a later rule may read an earlier one's normalised series) aside."""
    names: set[str] = set()
    recorded: set[str] = set()
    for profile in PROFILES.values():
        for record in sources.records(source, profile):
            recorded.add(record.record)
            for plain, alternatives in SELECTOR.findall(record.expr):
                names |= {plain} if plain else set(alternatives.split("|"))
    return names - recorded - {"up", ""}


def test_every_fixture_names_its_upstream_file_and_version():
    for files in FIXTURES_OF.values():
        for name in files:
            header = (FIXTURES / name).read_text().split("\n# HELP")[0]
            assert re.search(r"\d+\.\d+", header) and ("etc/" in header or "vllm/v1/" in header), name


@pytest.mark.parametrize("source", sorted(FIXTURES_OF))
def test_a_layer_reads_only_series_its_source_exposes(source):
    exposed = {series for f in FIXTURES_OF[source] for series in samples(f)}
    read = read_by(sources.SOURCES[source])
    assert read, source
    assert read <= exposed, f"{source}'s layer reads series no fixture exposes: {sorted(read - exposed)}"


@pytest.mark.parametrize("source", sorted(FIXTURES_OF))
def test_every_quantity_of_the_current_version_is_there_or_has_a_fallback(source):
    """What a fresh install exposes covers every quantity; older names are fallbacks only."""
    current = samples(CURRENT[source])
    for key, raw in sources.SOURCES[source].raw.items():
        suffix = "_count" if key in sources.HISTOGRAMS else ""
        if raw.metric + suffix not in current:
            assert source == "dcgm-exporter", f"{key}: {raw.metric} is not in {CURRENT[source]}"
            assert raw.metric in upstream.DCGM, f"{key}: {raw.metric} is not a dcgm-exporter field"


@pytest.mark.parametrize("source", sorted(FIXTURES_OF))
def test_the_labels_a_layer_renames_or_drops_are_on_the_series(source):
    """A rename of a label the source does not have would silently give every series one tenant."""
    src = sources.SOURCES[source]
    on_series = {label for f in FIXTURES_OF[source] for sets in samples(f).values()
                 for s in sets for label in s}
    for key, raw in src.raw.items():
        # exported_*: Prometheus' names for the exporter's pod labels under honorLabels false.
        needed = {*raw.labels.values(), *raw.drop} - {*dcgm.EXPORTED_KUBERNETES, "gpuscope_gi"}
        assert needed <= on_series | set(upstream.DCGM_KUBERNETES_LABELS), (key, needed - on_series)
    if source == "dcgm-exporter":
        scrape = {*dcgm.EXPORTED_KUBERNETES, "gpuscope_gi"}
        assert set(sources.DCGM_IDENTITY) - scrape <= on_series
        mig = samples("dcgm-exporter-4.x-mig.prom")
        assert all(set(upstream.DCGM_MIG_LABELS) <= set(s) for s in mig["DCGM_FI_DEV_FB_USED"][:2])
        assert all(set(upstream.DCGM_XID_LABELS) <= set(s) for s in mig["DCGM_FI_DEV_XID_ERRORS"])
        kube = samples("dcgm-exporter-4.x.prom")["DCGM_FI_DEV_FB_USED"]
        assert all(set(upstream.DCGM_KUBERNETES_LABELS) <= set(s) for s in kube)


def _buckets(family) -> list[float]:
    first = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in family.samples
             if s.name.endswith("_bucket")}
    key = sorted(first)[0]
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")
            and tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) == key]


def _family(found: dict[str, object], metric: catalogue.Metric):
    """The parsed family of a metric (prometheus_client names counter families without _total)."""
    return found[metric.base_name]


@pytest.mark.parametrize("metric", upstream.VLLM_METRICS, ids=lambda m: m.name)
def test_the_vllm_definitions_are_the_fixtures(metric):
    family = _family(families(CURRENT["vllm"]), metric)
    assert family.type == metric.type and family.documentation == metric.help
    labels = {label for s in family.samples for label in s.labels} - {"le"}
    assert labels == set(metric.labels)
    if metric.buckets:
        assert _buckets(family) == [*metric.buckets, float("inf")]


def test_the_vllm_finish_reasons_are_the_fixtures():
    reasons = {s.labels["finished_reason"] for s in families(CURRENT["vllm"])["vllm:request_success"].samples}
    assert reasons == set(upstream.VLLM_FINISH_REASONS)


@pytest.mark.parametrize("name", sorted(upstream.DCGM))
def test_the_dcgm_fields_are_typed_and_in_the_units_the_fixtures_say(name):
    kind, unit = upstream.DCGM[name]
    found = [families(f)[name] for f in FIXTURES_OF["dcgm-exporter"] if name in families(f)]
    assert found, f"{name} is in no dcgm-exporter fixture"
    for family in found:
        assert family.type == kind, name
        if unit in ("MiB", "MHz", "W", "mJ", "%"):
            assert f"(in {unit})" in family.documentation, (name, family.documentation)
        for sample in family.samples:
            assert set(upstream.DCGM_LABELS) <= set(sample.labels), sample


def test_the_stack_runs_the_vllm_source(tmp_path):
    """``gpuscope stack --stack.source vllm``: the server under vLLM's names, scraped as the vLLM
    source's job, and Prometheus loading that source's layer with the GPU exporter's."""
    import yaml

    from gpuscope.alerting import generate
    from gpuscope.ops.stack import Stack, StackOptions

    root = Path(__file__).resolve().parents[2]
    stack = Stack(StackOptions(profile="test", ports="free", source="vllm", run_dir=tmp_path, root=root,
                               components=("server", "prometheus")))
    stack.render_configs()
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert "vllm" in jobs and "gpuscope-server" not in jobs
    files = generate.stack_rule_files(PROFILES["test"], "vllm")
    assert config["rule_files"] == [str(root / f) for f in files]
    assert all((root / f).is_file() for f in files)
    server = stack._process("server").argv
    assert server[server.index("--metrics.names") + 1] == "vllm"


def test_the_drill_runs_what_the_vllm_source_can_detect():
    """``fault_drill --source vllm``: the latency spike is the step alert's; a leak has no vLLM series."""
    from gpuscope.loadtest import fault_drill
    from tests.conftest import usage_error

    assert fault_drill.VLLM_SCENARIOS["latency_spike"].alerts[0] == "GPUStepLatencySpike"
    assert fault_drill.evidence_s("GPUStepLatencySpike") == PROFILES["test"].windows.latency
    line = usage_error("gpuscope.loadtest.fault_drill", "--source", "vllm", "--scenarios", "memory_leak")
    assert "unknown scenario 'memory_leak' for --source vllm" in line
