"""``gpuscope diagnose``: sample this box (or judge a past window in Prometheus) and say what is wrong.

Exit status: 0 no problem found (warnings may be printed), 1 at least one problem found (a server the
user named that did not answer is one), 2 a bad flag, 3 nothing could be judged (Prometheus
unreachable or without data for the window).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import time
from dataclasses import dataclass

from gpuscope.contract.parts import LOCAL_HOST, PORTS
from gpuscope.diagnose import history, view
from gpuscope.diagnose.live import LiveSampler
from gpuscope.diagnose.summary import Summary
from gpuscope.diagnose.verdicts import judge
from gpuscope.util.flags import parse_duration
from gpuscope.util.settings import parser_for, setting

OK, PROBLEM, USAGE, UNOBSERVED = 0, 1, 2, 3
_SINCE = re.compile(r"^(\d+)([smhd])$")
#: Where a server is looked for when none is named: a finding only if it answers.
DEFAULT_SERVER = f"http://{LOCAL_HOST}:{PORTS['server']}/metrics"
#: Flags that choose what a past window is: without --prometheus they would silently do nothing.
_HISTORY_ONLY = ("--since", "--host")


def parse_since(text: str) -> int:
    """A Prometheus duration of whole units (``90s``, ``30m``, ``2h``, ``1d``) → seconds (>= 1 m)."""
    match = _SINCE.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration such as 30m, 2h or 1d")
    seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    if seconds < 60:
        raise ValueError(f"{text!r}: the window must be at least 1m (recording rules are rates over minutes)")
    return seconds


@dataclass(frozen=True)
class DiagnoseSettings:
    """The flags of ``gpuscope diagnose``."""

    duration: float = setting("--duration", 10.0, "live sampling window (10s, 1m...)", parse=parse_duration)
    interval: float = setting("--interval", 1.0, "one reading every ... (1s)", parse=parse_duration)
    #: None: not named, so the default address is tried and silence there is no finding.
    server: str | None = setting("--server", None, "the server's or vLLM's /metrics URL; one named here "
                                 "that does not answer is a problem (default: "
                                 f"{DEFAULT_SERVER}, judged only if it answers; empty: none)")
    prometheus: str | None = setting("--prometheus", None, "judge a past window from this Prometheus' "
                                     "recording rules instead of sampling")
    since: int = setting("--since", 30 * 60, "with --prometheus: the window ending now (30m, 2h, 1d)",
                         parse=parse_since)
    host: str | None = setting("--host", None,
                               "with --prometheus: judge only this host (default: every host)")
    json: bool = setting("--json", False, "print one JSON document, no live view")
    json_file: str | None = setting("--json-file", None, "also write the JSON document to this file (a "
                                    "transcript for people on stdout, the numbers for scripts)")


def parse_args(argv: list[str]) -> DiagnoseSettings:
    p = parser_for(DiagnoseSettings, prog="gpuscope diagnose", description=(
        "Sample host CPU and memory, every GPU (NVML) and the server's /metrics for a window, then name "
        "what is wrong, with the numbers. Exit status: 0 no problem, 1 problem found, 2 bad flag, "
        "3 nothing could be judged."))
    args = p.parse_settings(argv)
    if args.prometheus is None:
        for flag in _HISTORY_ONLY:
            if _on_command_line(argv, flag):
                p.error(f"{flag} chooses a past window and needs --prometheus URL (a live window's length "
                        "is --duration)")
    if args.interval > args.duration:
        p.error(f"--interval {args.interval}s is longer than --duration {args.duration}s")
    if args.server and not re.match(r"^https?://", args.server):
        p.error(f"--server {args.server!r} is not an http(s) URL")
    if args.prometheus is not None and not re.match(r"^https?://", args.prometheus):
        p.error(f"--prometheus {args.prometheus!r} is not an http(s) URL")
    return args


def _on_command_line(argv: list[str], flag: str) -> bool:
    """``flag`` given in argv (argparse takes a unique prefix: ``--si`` is ``--since``).

    Only the command line counts: the environment variables (``GPUSCOPE_HOST`` is also what the fleet's
    vmagent reads) are standing settings for when --prometheus is given, not a request for this run.
    """
    for token in argv:
        name = token.split("=", 1)[0]
        if len(name) > 2 and name.startswith("--") and flag.startswith(name):
            return True
    return False


def report(summaries: list[Summary], as_json: bool, json_file: str | None = None, out=sys.stdout) -> int:
    """Print the table and verdict of each summary (or JSON); the exit status."""
    results = [(s, judge(s)) for s in summaries]
    problem = any(f.severity == "problem" for _, findings in results for f in findings)
    status = PROBLEM if problem else OK
    document = {"summaries": [{"summary": s.to_json(), "findings": [f.to_json() for f in fs]}
                              for s, fs in results], "exit_status": status}
    if json_file:
        try:
            with open(json_file, "w") as fh:
                json.dump(document, fh, indent=1)
        except OSError as exc:  # the verdict still goes to stdout
            sys.stderr.write(f"gpuscope diagnose: cannot write --json-file: {exc}\n")
    if as_json:
        json.dump(document, out, indent=1)
        out.write("\n")
    else:
        for s, findings in results:
            out.write(view.table(s) + "\n\n" + view.verdict(findings))
    return status


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.prometheus:
        try:
            query = history.prometheus_query(args.prometheus, time.time())
            summaries = history.judge_window(query, args.since, args.host)
        except history.HistoryError as exc:
            sys.stderr.write(f"gpuscope diagnose: {exc}\n")
            return UNOBSERVED
        if not summaries:
            sys.stderr.write(f"gpuscope diagnose: no series in Prometheus for the last {args.since}s"
                             f"{' on host ' + args.host if args.host else ''}\n")
            return UNOBSERVED
        return report(summaries, args.json, args.json_file)
    # The in-process exporter logs NVML trouble (no library on a CPU host); the table says it instead.
    logging.getLogger("gpuscope.exporter").setLevel(logging.ERROR)
    live = sys.stdout.isatty() and not args.json
    url = DEFAULT_SERVER if args.server is None else args.server
    sampler = LiveSampler(args.duration, args.interval, url or None, server_asked=bool(args.server))
    host = socket.gethostname()
    on_tick = (lambda window, share: sys.stdout.write(view.live_frame(window, share, host))) if live else None
    try:
        window = sampler.run(on_tick)
    except KeyboardInterrupt:  # judge what was sampled so far
        window = sampler.window
        if not window.ticks:
            return OK
    if live:
        sys.stdout.write(view.CLEAR)
    return report([window.summary(host)], args.json, args.json_file)
