"""The kubelet's PodResources API, v1: the vendored ``api.proto`` and its generated Python stubs.

``api.proto`` is Kubernetes' own (see its header for the source and version); ``api_pb2.py`` and
``api_pb2_grpc.py`` are generated from it by ``python -m gpuscope.nvml.podresources_v1.regenerate``
with the ``grpcio-tools`` version pinned in pyproject.toml's ``dev`` extra, and committed, so the
exporter needs only ``grpcio`` and ``protobuf`` at run time (pyproject's ``kubernetes`` extra).
A test regenerates them and fails on any difference.
"""
