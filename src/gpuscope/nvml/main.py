"""``gpuscope exporter``: parse flags, start the exporter, serve until SIGTERM or SIGINT.

Every flag is a field of ``config.Config``; ``--help`` lists them all.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from gpuscope.nvml.config import parse
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.http import ExporterServer
from gpuscope.util.logsafe import EscapingFilter

log = logging.getLogger("gpuscope.exporter")
#: How long a thread may hold the GIL while another waits for it (Python's default is 5 ms). The
#: background renderer holds it for tens of ms on a host with many GPUs; a scrape arriving meanwhile
#: would wait up to the whole default interval, so the exporter hands the GIL over ten times sooner
#: (docs/exporter.md gives the scrape p99 at 64 fake GPUs either way, from benchmarks/scrape_bench.py).
GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    """Run the exporter; 0 after a clean shutdown, 1 if the address cannot be bound, 2 on a bad flag."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = parse(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=config.log_level.number, stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s msg=%(message)s")
    for handler in logging.getLogger().handlers:  # one record, one line, whatever a message holds
        handler.addFilter(EscapingFilter())
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    exporter = Exporter(config)
    try:
        server = ExporterServer(config.listen, exporter.metrics, exporter.healthz,
                                max_connections=config.max_connections, read_timeout=config.read_timeout)
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
