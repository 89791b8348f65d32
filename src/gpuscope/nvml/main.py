"""``gpuscope exporter``: parse flags, start the exporter, serve until SIGTERM or SIGINT.

The HTTP server's connection limits (``--web.max-connections``, ``--web.read-timeout``) are
flags of this module; every other flag is ``config.py``'s. ``--help`` lists them all.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from gpuscope.nvml import config as flags
from gpuscope.nvml.config import parse
from gpuscope.nvml.exporter import Exporter
from gpuscope.nvml.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT, ExporterServer
from gpuscope.util.flags import FlagParser, checked, parse_duration
from gpuscope.util.logsafe import EscapingFilter

log = logging.getLogger("gpuscope.exporter")
#: How long a thread may hold the GIL while another waits for it (Python's default is 5 ms). The
#: background renderer holds it for tens of ms on a host with many GPUs; a scrape arriving meanwhile
#: would wait up to the whole default interval, so the exporter hands the GIL over ten times sooner
#: (scrape p99 at 64 fake GPUs: 4.7 ms at the default, 1.6 ms at 0.5 ms; benchmarks/scrape_bench.py).
GIL_SWITCH_INTERVAL_S = 0.0005
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}


def _connections(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def _add_web_flags(parser: FlagParser) -> None:
    parser.add_flag("--web.max-connections", dest="max_connections", type=checked(_connections),
                    default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                    help="most HTTP connections at once, one thread each; at the limit the one waiting "
                         "longest for a request is closed, or with all busy the new one gets a 503 "
                         f"(default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_flag("--web.read-timeout", dest="read_timeout", type=checked(parse_duration),
                    default=DEFAULT_READ_TIMEOUT, metavar="DURATION",
                    help="a connection must deliver each whole request within this (idle keep-alive "
                         f"time included), else it is closed (default {DEFAULT_READ_TIMEOUT:g}s)")


def build_parser() -> FlagParser:
    """Every flag of ``gpuscope exporter``: config.py's and the connection limits."""
    parser = flags.build_parser()
    _add_web_flags(parser)
    return parser


def parse_web_flags(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the connection limits, the other flags, for ``config.parse``)."""
    parser = FlagParser(prog="gpuscope exporter", add_help=False, allow_abbrev=False)
    _add_web_flags(parser)
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the exporter; 0 after a clean shutdown, 1 if the address cannot be bound, 2 on a bad flag."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        build_parser().parse_args(argv)  # --help, and bad or unknown flags, with every flag known
        web, rest = parse_web_flags(argv)
        config = parse(rest)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=_LEVELS[config.log_level], stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s msg=%(message)s")
    for handler in logging.getLogger().handlers:  # one record, one line, whatever a message holds
        handler.addFilter(EscapingFilter())
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    exporter = Exporter(config)
    try:
        server = ExporterServer(config.listen, exporter.metrics, exporter.healthz,
                                max_connections=web.max_connections, read_timeout=web.read_timeout)
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
