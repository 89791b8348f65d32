"""Span attributes that more than the server reads: the Collector's tail-sampling policy
(``gpuscope.otelcol``) keeps traces by OUTCOME and TTFT_MS, Grafana's trace-to-metrics links read
TENANT. The server's other attributes are its own (``gpuscope.server.tracing``).
"""

TENANT = "gpuscope.tenant"
OUTCOME = "gpuscope.outcome"  # stop, length, abort, error, rejected, invalid
TTFT_MS = "gpuscope.ttft_ms"  # arrival → first token, whole ms rounded up (> objective ⇔ ≥ objective + 1)
