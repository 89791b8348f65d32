"""``gpuscope exporter``: parse flags, start the exporter, serve until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from gpuscope.nvml.config import parse
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.server import ExporterServer

log = logging.getLogger("gpuscope.exporter")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def main(argv: list[str] | None = None) -> int:
    """Run the exporter; 0 after a clean shutdown, 1 if the address cannot be bound, 2 on a bad flag."""
    try:
        config = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=_LEVELS[config.log_level], stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s msg=%(message)s")
    exporter = Exporter(config)
    try:
        server = ExporterServer(config.listen, exporter.registry, exporter.healthz)
    except OSError as exc:
        sys.stderr.write(f"gpuscope exporter: error: cannot listen on {config.listen[0]}:{config.listen[1]}: "
                         f"{exc.strerror or exc}\n")
        return 1
    exporter.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.serve_in_thread()
    log.info("serving %s/metrics", server.url)
    stop.wait()
    log.info("shutting down")
    server.shutdown()
    server.server_close()
    exporter.stop()
    return 0
