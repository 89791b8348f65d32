"""``gpuscope loadtest``: Locust with the bundle's locustfile (``gpuscope.loadtest.locustfile``).

The same as ``locust -f loadtest/`` from a checkout, from wherever the package is installed: every
flag is Locust's or one the locustfile adds (docs/loadtest.md), passed through unchanged. Without
``--host`` (or ``-H``) it loads the reference server at its default address. Locust replaces this
process, so Ctrl-C and its exit status are Locust's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gpuscope.contract.parts import LOCAL_HOST, PORTS

from .runtools import LOCUSTFILE, locust_available, locust_prefix

PROG = "gpuscope loadtest"
DEFAULT_HOST = f"http://{LOCAL_HOST}:{PORTS['server']}"
_HOST_FLAGS = ("--host", "-H")
_FILE_FLAGS = ("-f", "--locustfile")


def locust_argv(argv: Sequence[str]) -> list[str]:
    """The Locust command line for ``gpuscope loadtest ARGV``: the bundle's locustfile first, and the
    default server as host unless ARGV names one. ValueError when ARGV names another locustfile."""
    args = list(argv)
    for arg in args:
        if arg in _FILE_FLAGS or arg.startswith(tuple(f + "=" for f in _FILE_FLAGS)):
            raise ValueError(f"{arg!r}: {PROG} runs the bundle's locustfile; for your own, run locust -f")
    has_host = any(a in _HOST_FLAGS or a.startswith("--host=") or (a.startswith("-H") and len(a) > 2)
                   for a in args)
    host = [] if has_host or "--worker" in args else ["--host", DEFAULT_HOST]
    return [*locust_prefix(), "-f", str(LOCUSTFILE), *host, *args]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not locust_available():
        sys.stderr.write(f"{PROG}: error: Locust is not installed: pip install 'gpuscope[loadtest]'\n")
        return 2
    try:
        command = locust_argv(args)
    except ValueError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    if args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(f"{PROG}: Locust with gpuscope's locustfile (streaming users per tenant, load "
                         f"shapes); default --host {DEFAULT_HOST}. Locust's help follows.\n\n")
        sys.stdout.flush()
    os.execv(command[0], command)
    return 0  # not reached: Locust replaced this process


if __name__ == "__main__":
    raise SystemExit(main())
