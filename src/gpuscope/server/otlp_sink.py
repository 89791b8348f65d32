"""A local OTLP/HTTP traces endpoint that decodes what ``gpuscope serve --tracing.endpoint`` sends.

The tracing tests read the spans that arrived over the wire, and the tracing benchmark counts them
against what the server says it exported; both need the same thing an OpenTelemetry Collector would
be, without running one: ``POST /v1/traces`` with a protobuf ``ExportTraceServiceRequest``
(gzip-encoded or not), answered with an ``ExportTraceServiceResponse``. Decoding uses
opentelemetry-proto (the tracing extra), the package the server's exporter encodes with.

    sink = OtlpSink()
    ... gpuscope serve --tracing.endpoint {sink.url} ...
    sink.span_count, list(sink.spans()); sink.stop()
"""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Iterator
from typing import Any

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"


class OtlpSink:
    """OTLP/HTTP on 127.0.0.1 (a free port): ``url`` is its base, as ``--tracing.endpoint`` takes it.

    ``span_count`` counts every span accepted. With ``keep`` (the default) every decoded request is
    kept in ``requests`` for :meth:`spans`; a long benchmark passes ``keep=False`` and only counts.
    ``status`` is what it answers (set 400 to make the exporter drop a batch); a request to another
    path or of another content type gets 404.
    """

    def __init__(self, keep: bool = True) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.requests: list[Any] = []
        self.span_count = 0
        self.status = 200
        self.lock = threading.Lock()
        sink = self
        answer = ExportTraceServiceResponse().SerializeToString()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == TRACES_PATH and self.headers["Content-Type"] == PROTOBUF
                if ok and sink.status == 200:
                    message = ExportTraceServiceRequest.FromString(body)
                    count = sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)
                    with sink.lock:
                        sink.span_count += count
                        if keep:
                            sink.requests.append(message)
                self.send_response(sink.status if ok else 404)
                self.send_header("Content-Type", PROTOBUF)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="otlp-sink", daemon=True).start()

    def spans(self) -> Iterator[tuple[dict[str, str], Any]]:
        """Every kept span with its resource's string attributes, in arrival order."""
        with self.lock:
            requests = list(self.requests)
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        yield resource, span

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
