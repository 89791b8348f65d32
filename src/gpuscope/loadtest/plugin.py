"""Locust event listeners: gpuscope's options, and the exact recorder across processes.

Importing this module registers the listeners once (Python imports a module once
per process, however many locustfiles import it). Flow of exact figures:

* every process: ``init`` attaches a :class:`Recorder` as ``environment.gpuscope_recorder``
  (:func:`install`); ``test_start`` empties it;
* a worker: ``report_to_master`` adds what it recorded since the last report to
  Locust's periodic stats message (and to the final one sent on quit);
* master or single process: ``worker_report`` merges those batches; ``quitting``
  writes ``--samples-file`` and logs a one-line exact summary per tenant.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from locust import events
from locust.runners import WorkerRunner

from gpuscope.loadtest.options import add_locust_arguments
from gpuscope.loadtest.recorder import Recorder
from gpuscope.loadtest.stats import summarise, tenants_of

log = logging.getLogger("gpuscope.loadtest")
REPORT_KEY = "gpuscope_samples"


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any, **_: Any) -> None:
    add_locust_arguments(parser)


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    install(environment)


def install(environment: Any) -> Recorder:
    """Attach a recorder to this environment and hook it to the environment's events.

    Listeners close over the environment because ``report_to_master`` and
    ``worker_report`` do not pass it; a test can install into its own
    ``Environment(events=Events())`` without touching Locust's global events.
    """
    recorder = Recorder()
    environment.gpuscope_recorder = recorder
    hooks = environment.events

    def reset(**_: Any) -> None:
        recorder.reset(time.time())

    def mark_stop(**_: Any) -> None:
        recorder.stopped = time.time()

    def ship(client_id: str, data: dict[str, Any], **_: Any) -> None:
        data[REPORT_KEY] = recorder.take_unshipped()

    def collect(client_id: str, data: dict[str, Any], **_: Any) -> None:
        if REPORT_KEY in data:
            recorder.merge(data[REPORT_KEY])

    def write(**_: Any) -> None:
        if not isinstance(environment.runner, WorkerRunner):
            finish(environment)

    hooks.test_start.add_listener(reset)
    hooks.test_stop.add_listener(mark_stop)
    hooks.report_to_master.add_listener(ship)
    hooks.worker_report.add_listener(collect)
    hooks.quitting.add_listener(write)
    return recorder


def finish(environment: Any) -> None:
    """Log the exact summary and write ``--samples-file`` (master or single process)."""
    recorder: Recorder = environment.gpuscope_recorder
    if recorder.started is None:
        return
    if recorder.stopped is None:
        recorder.stopped = time.time()
    for line in summary_lines(recorder):
        log.info(line)
    options = environment.parsed_options
    path = getattr(options, "samples_file", "") if options is not None else ""
    if path:
        recorder.write(path)
        log.info("gpuscope: exact figures of %d requests written to %s", len(recorder.requests), path)


def summary_lines(recorder: Recorder) -> list[str]:
    """Exact figures for the console: one line for all tenants, then one per tenant."""
    if not recorder.requests or recorder.started is None or recorder.stopped is None:
        return ["gpuscope exact: no requests recorded"]
    lines = []
    for tenant in (None, *tenants_of(recorder.requests)):
        s = summarise(recorder.requests, recorder.started, recorder.stopped + 1e-9, tenant)
        lines.append(
            f"gpuscope exact [{tenant or 'all'}]: {s.requests} requests, {s.rps:.2f} req/s, "
            f"{s.tps:.1f} tok/s, errors {s.error_rate:.1%}, TTFT p50 {_ms(s.ttft_p50_s)} "
            f"p99 {_ms(s.ttft_p99_s)}, ITL p50 {_ms(s.itl_p50_s)} p99 {_ms(s.itl_p99_s)}, "
            f"e2e p99 {_ms(s.e2e_p99_s)}")
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"

