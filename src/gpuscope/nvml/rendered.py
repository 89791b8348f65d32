"""The scrape body, rendered in the background: a scrape copies bytes instead of rendering them.

Rendering an exposition costs time in proportion to its series (thousands with 64 GPUs and
per-process attribution), so a scrape that renders grows with the GPU count. Here a renderer
thread re-renders after sampling rounds end (waiting ``coalesce_s`` so rounds that end together
are one render, and at most once per ``min_period``) and a scrape serves the last bytes. Only
what changes between rounds is rendered per scrape: the age of the values served
(``gpuscope_exporter_staleness_seconds``, which grows until the next render), one series per
collector whatever the number of GPUs.

The rendering cost does not go away, it leaves the scrape path: a full render grows with the
number of GPUs, and is paid once or twice per sampling interval in the background instead of
inside every scrape (``benchmarks/scrape_bench.py`` measures both; docs/exporter.md, "Cost").

The live part is not rendered by prometheus_client on every scrape either (for a few series its
per-call work was a large share of a cached scrape: docs/exporter.md, "Cost"): ``LiveTemplate``
learns, once per content type and set of series, what the encoder writes around each sample value,
and a scrape fills in the values.

Bodies are cached per negotiated content type (Prometheus text 0.0.4, OpenMetrics 1.0.0, ...):
the first scrape asking for a format renders it once, and from then on it is kept current in the
background too. A render that fails keeps serving the last good body and is counted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

OPENMETRICS_EOF = b"# EOF\n"
#: content types kept current at once (a client that invents variants cannot grow the cache)
MAX_FORMATS = 8


class _Collectors:
    """What the encoders take: anything with ``collect()``."""

    def __init__(self, collectors: Iterable[Collector]) -> None:
        self._collectors = list(collectors)

    def collect(self) -> Iterator:
        for collector in self._collectors:
            yield from collector.collect()


_UNKNOWN = object()


class LiveTemplate:
    """Families whose series stay the same while their values change, rendered by filling values in.

    ``render(families, content_type, encoder)`` equals ``encoder(families)`` byte for byte: the first
    time a content type meets a set of series (names and labels) it renders them once with a distinct
    sentinel value per sample and keeps the text between the sentinels; later calls format the
    current values as the encoders do (``floatToGoString``) and join. Series that cannot be
    templated (a sample with a timestamp or exemplar, a sentinel not found) are rendered by the
    encoder every time.
    """

    def __init__(self) -> None:
        self._pieces: dict[tuple, list[bytes] | None] = {}

    def render(self, families: list[Metric], content_type: str, encoder: Callable) -> bytes:
        samples = [sample for family in families for sample in family.samples]
        key = (content_type, tuple((family.name, family.type, family.documentation) for family in families),
               tuple((sample.name, tuple(sample.labels.items())) for sample in samples))
        pieces = self._pieces.get(key, _UNKNOWN)  # one lookup: scrapes on other threads may clear it
        if pieces is _UNKNOWN:
            pieces = self._learn(families, encoder)
            if len(self._pieces) >= MAX_FORMATS * 4:  # series that keep changing: start over
                self._pieces.clear()
            self._pieces[key] = pieces
        if pieces is None:
            return encoder(_Families(families))
        out = [pieces[0]]
        for sample, piece in zip(samples, pieces[1:], strict=True):
            out.append(floatToGoString(sample.value).encode())
            out.append(piece)
        return b"".join(out)

    @staticmethod
    def _learn(families: list[Metric], encoder: Callable) -> list[bytes] | None:
        sentinels = []
        marked = []
        for family in families:
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                if sample.timestamp is not None or sample.exemplar is not None:
                    return None
                sentinels.append(float(f"{len(sentinels) + 1}e250"))
                copy.samples.append(sample._replace(value=sentinels[-1]))
            marked.append(copy)
        text = encoder(_Families(marked))
        pieces, start = [], 0
        for sentinel in sentinels:
            mark = b" " + floatToGoString(sentinel).encode()
            at = text.find(mark + b"\n", start)
            if at < 0:
                return None
            pieces.append(text[start:at + 1])
            start = at + len(mark)
        pieces.append(text[start:])
        return pieces


class _Families:
    """Families already collected, as the encoders take them."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class RenderedExposition:
    """``body(accept)`` → (bytes, content type): the cached families plus the live ones.

    Args:
        cached: collectors whose output changes only when ``changed`` is set (the samplers' data).
        live: collectors rendered on every scrape (few series each).
        changed: set by whoever publishes new data; the renderer clears it and renders.
        min_period: least seconds between the starts of two background renders.
        coalesce_s: wait after a change before rendering, so rounds that end together render once.
        on_error: called with the exception when a render fails (the exporter counts it).
    """

    def __init__(self, cached: Iterable[Collector], live: Iterable[Collector], changed: threading.Event,
                 min_period: float = 0.5, coalesce_s: float = 0.05,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self._cached = _Collectors(cached)
        self._live = _Collectors(live)
        self._changed = changed
        self._min_period = min_period
        self._coalesce_s = coalesce_s
        self._on_error = on_error
        self._lock = threading.Lock()  # guards _encoders; never held while rendering
        self._encoders: dict[str, Callable] = {}
        self._bodies: dict[str, bytes] = {}
        self._live_template = LiveTemplate()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuscope-render", daemon=True)
        self.renders = 0

    def start(self) -> RenderedExposition:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._changed.set()  # wake the renderer
        if self._thread.is_alive():
            self._thread.join(timeout)

    def body(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        cached = self._bodies.get(content_type)
        if cached is None:
            cached = self._render_cached(content_type, encoder)
            with self._lock:
                if len(self._encoders) < MAX_FORMATS:
                    self._encoders[content_type] = encoder
        live = self._live_template.render(list(self._live.collect()), content_type, encoder)
        if cached.endswith(OPENMETRICS_EOF):  # one exposition has one EOF, at its very end
            cached = cached[: -len(OPENMETRICS_EOF)]
        return cached + live, content_type

    def _render_cached(self, content_type: str, encoder: Callable) -> bytes:
        body = encoder(self._cached)
        self._bodies[content_type] = body  # one dict store: atomic for readers
        self.renders += 1
        return body

    def _run(self) -> None:
        while not self._stop.is_set():
            self._changed.wait()
            if self._stop.wait(self._coalesce_s):
                return
            started = time.monotonic()
            self._changed.clear()
            with self._lock:
                formats = list(self._encoders.items())
            for content_type, encoder in formats:
                try:
                    self._render_cached(content_type, encoder)
                except Exception as exc:  # keep serving the last good body
                    if self._on_error is not None:
                        self._on_error(exc)
            self._stop.wait(max(0.0, started + self._min_period - time.monotonic()))
