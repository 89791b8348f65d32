"""gpuscope: GPU observability for model-inference services.

Subpackages: ``gpuscope.timing`` (CUDA-event kernel timer), ``gpuscope.nvml``
(node exporter), ``gpuscope.server`` (reference inference server),
``gpuscope.logs.loki_push`` (log shipping); ``gpuscope.contract.catalogue`` names every metric.
"""

__version__ = "0.1.0"
