"""Generator of the OpenTelemetry Collector's configuration (``config``: deploy/otel-collector/config.yaml,
written by ``gpuscope generate``)."""
