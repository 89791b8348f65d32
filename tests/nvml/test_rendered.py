"""The exposition served from bytes rendered in the background (``rendered.py``)."""

from __future__ import annotations

import threading

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuscope.contract import catalogue as cat
from gpuscope.nvml.rendered import RenderedExposition
from tests.conftest import promtool_check_metrics, wait_for
from tests.nvml.conftest import wait_first_rounds
from tests.nvml.fake_nvml import FakeGpu, FakeNvml

TEXT = ""
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def sample(body: bytes, name: str, parse=parse_text, **labels: str) -> float | None:
    for family in parse(body.decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_a_scrape_serves_what_the_samplers_published_last(start_exporter) -> None:
    nv = FakeNvml([FakeGpu(temp_c=40)])
    ex = start_exporter(nv)
    wait_first_rounds(ex)
    body, content_type = ex.metrics(TEXT)
    assert content_type.startswith("text/plain; version=0.0.4")
    assert sample(body, cat.GPU_TEMPERATURE.name, gpu="0") == 40
    nv.gpus[0].temp_c = 71
    wait_for(lambda: sample(ex.metrics(TEXT)[0], cat.GPU_TEMPERATURE.name, gpu="0") == 71,
             what="the new temperature in the served body")
    promtool_check_metrics(ex.metrics(TEXT)[0].decode())


def test_staleness_is_read_at_scrape_time() -> None:
    """Between rounds nothing is re-rendered, yet the age of the values served keeps growing."""
    clock = [100.0]
    from gpuscope.nvml.exposition import StalenessCollector
    from gpuscope.nvml.store import Store

    store = Store(clock=lambda: clock[0])
    store.register("device")
    store.finish_round("device", 0.01, True)
    changed = threading.Event()
    exposition = RenderedExposition([], [StalenessCollector(store, clock=lambda: clock[0])], changed)
    first = sample(exposition.body(TEXT)[0], cat.EXPORTER_STALENESS.name, collector="device")
    clock[0] += 7.5
    later = sample(exposition.body(TEXT)[0], cat.EXPORTER_STALENESS.name, collector="device")
    assert (first, later) == (0.0, 7.5)


class CountingCollector:
    def __init__(self) -> None:
        self.collects = 0
        self.fail = False
        self.value = 1.0

    def collect(self):
        self.collects += 1
        if self.fail:
            raise RuntimeError("render broke")
        family = cat.EXPORTER_GPUS.family()
        family.add_metric([], self.value)
        yield family


def test_scrapes_do_not_render_the_cached_part_and_changes_do() -> None:
    cached, changed, errors = CountingCollector(), threading.Event(), []
    exposition = RenderedExposition([cached], [], changed, min_period=0.0, coalesce_s=0.0,
                                    on_error=errors.append).start()
    try:
        for _ in range(50):
            exposition.body(TEXT)
        assert cached.collects == 1  # the first scrape of a format renders it, the rest copy bytes
        cached.value = 2.0
        changed.set()
        wait_for(lambda: sample(exposition.body(TEXT)[0], cat.EXPORTER_GPUS.name) == 2.0,
                 what="a background render after the change")
        # A render that fails keeps the last good body and is reported.
        cached.fail, cached.value = True, 3.0
        changed.set()
        wait_for(lambda: errors, what="the failed render reported")
        assert sample(exposition.body(TEXT)[0], cat.EXPORTER_GPUS.name) == 2.0
    finally:
        exposition.stop()


def test_openmetrics_body_has_one_eof_at_its_end_and_parses(start_exporter) -> None:
    ex = start_exporter(FakeNvml())
    wait_first_rounds(ex)
    body, content_type = ex.metrics(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    families = {f.name for f in parse_openmetrics(text)}  # strict: fails on a misplaced EOF or duplicate
    assert {cat.EXPORTER_STALENESS.name, "process_cpu_seconds", cat.GPU_TEMPERATURE.name} <= families


def families(values: dict[str, float], help_text: str = "Age of the cached values served.") -> list:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    gauge = GaugeMetricFamily("gpuscope_test_age_seconds", help_text, labels=["collector"])
    for name, value in values.items():
        gauge.add_metric([name], value)
    counter = CounterMetricFamily("gpuscope_test_closed", 'Closed "connections".', labels=["reason"])
    counter.add_metric(["timeout"], 3.0, created=1700000000.25)
    return [gauge, counter]


def test_the_live_template_writes_what_each_encoder_writes() -> None:
    """Filled-in values give the encoder's own bytes, in both formats, for values of every kind,
    and for a new set of series (a collector appearing) too."""
    from prometheus_client.exposition import choose_encoder

    from gpuscope.nvml.rendered import LiveTemplate

    template = LiveTemplate()
    cases = [{"device": 0.25, "energy": 4.709017038345337}, {"device": 1e-7, "energy": float("inf")},
             {"device": 12345678.0, "energy": 0.0}, {"device": 2.5, "energy": 3.0, "xid": 0.1}]
    for accept in (TEXT, OPENMETRICS):
        encoder, content_type = choose_encoder(accept)
        for values in cases:

            class Collected:
                def collect(self, values=values):
                    return families(values)

            assert template.render(families(values), content_type, encoder) == encoder(Collected())


def test_the_live_template_falls_back_to_the_encoder_for_what_it_cannot_template() -> None:
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.exposition import choose_encoder

    from gpuscope.nvml.rendered import LiveTemplate

    gauge = GaugeMetricFamily("gpuscope_test_age_seconds", "Age.", labels=["collector"])
    gauge.add_metric(["device"], 0.5, timestamp=1700000000.0)  # timestamps are not templated
    encoder, content_type = choose_encoder(TEXT)

    class Collected:
        def collect(self):
            return [gauge]

    assert LiveTemplate().render([gauge], content_type, encoder) == encoder(Collected())
