"""NVML node exporter (``gpuscope exporter``): background sampling, cached state, cheap scrapes.

Modules, one job each: ``api`` (the NVML boundary), ``devices`` (discovery, labels),
``calls`` (error policy per call), ``collectors`` (what is read), ``lane``/``sampler``
(threads and timeouts), ``store`` (cached state), ``exposition`` (the scrape), ``xid``
(XID events), ``procinfo`` (process names, container ids), ``config`` (flags),
``server`` (HTTP), ``exporter`` (assembly), ``main`` (the command).
"""

from gpuscope.nvml.config import Config, parse
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.http import ExporterServer

__all__ = ["Config", "Exporter", "ExporterServer", "parse"]
