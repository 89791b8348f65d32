"""Log shipping: ``loki_push.LokiHandler``, a logging handler that batches records to Loki's push API."""
