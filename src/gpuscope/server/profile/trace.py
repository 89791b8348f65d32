"""Trace files of profile captures: Chrome trace JSON (what Perfetto and chrome://tracing open),
capped in events and bytes, written atomically, and a retention limit on the directory.

The format is the Trace Event Format's JSON object form: ``{"traceEvents": [...], "otherData":
{...}}``; complete events (``"ph": "X"``) carry ``ts`` and ``dur`` in microseconds, metadata events
(``"ph": "M"``) name processes and threads. torch.profiler's ``export_chrome_trace`` writes the same
form, so both kinds of capture pass through :func:`cap_events`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from typing import Any

#: Trace file names: ``profile-<UTC time>-<capture id>.json``; nothing else in the directory is touched.
FILE_PATTERN = re.compile(r"^profile-\d{8}T\d{6}Z-([0-9a-f]{12})\.json$")
#: Event categories kept first when a cap bites: what the capture is for (GPU kernels and the
#: regions and steps that frame them), then everything else in time order.
FIRST_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "region", "step",
                    "user_annotation")


def file_name(stamp: str, capture_id: str) -> str:
    return f"profile-{stamp}-{capture_id}.json"


def cap_events(events: list[dict[str, Any]], max_events: int) -> tuple[list[dict[str, Any]], int]:
    """At most ``max_events`` events: metadata always, then FIRST_CATEGORIES, then the rest, each in
    time order. Returns (kept events in time order, metadata first; how many were left out)."""
    if len(events) <= max_events:
        return events, 0
    meta = [e for e in events if e.get("ph") == "M"]
    rank = {cat: i for i, cat in enumerate(FIRST_CATEGORIES)}
    others = [e for e in events if e.get("ph") != "M"]
    others.sort(key=lambda e: (rank.get(str(e.get("cat", "")).lower(), len(rank)), _ts(e)))
    room = max(0, max_events - len(meta))
    kept = sorted(others[:room], key=_ts)
    return meta + kept, len(others) - len(kept)


def _ts(event: dict[str, Any]) -> float:
    ts = event.get("ts", 0)
    try:
        return float(ts)
    except (TypeError, ValueError):
        return 0.0


def encode(trace: dict[str, Any], max_bytes: int) -> tuple[bytes, int]:
    """The trace as UTF-8 JSON of at most ``max_bytes``: while over, the latest non-metadata events
    are left out (a trace is read from its start). Returns (bytes, events left out)."""
    events: list[dict[str, Any]] = trace.get("traceEvents", [])
    body = _dumps(trace)
    dropped = 0
    while len(body) > max_bytes and events:
        meta = [e for e in events if e.get("ph") == "M"]
        rest = [e for e in events if e.get("ph") != "M"]
        if not rest:
            break
        # Shrink in proportion to the excess (at least one event), then check again.
        keep = max(0, min(len(rest) - 1, int(len(rest) * max_bytes / len(body) * 0.95)))
        dropped += len(rest) - keep
        events = meta + rest[:keep]
        trace = {**trace, "traceEvents": events}
        trace.setdefault("otherData", {})["events_left_out_bytes"] = dropped
        body = _dumps(trace)
    return body, dropped


def _dumps(trace: dict[str, Any]) -> bytes:
    return json.dumps(trace, separators=(",", ":"), allow_nan=False, default=str).encode()


def write_atomic(directory: str, name: str, body: bytes) -> str:
    """Write ``body`` to ``directory/name`` through a temporary file and a rename (a reader never sees
    half a trace). Returns the path."""
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        path = os.path.join(directory, name)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def trace_files(directory: str) -> list[str]:
    """The directory's trace files (by FILE_PATTERN), oldest written first. By modification time, not
    name: names carry the request's second, and several captures can be asked for within one."""
    try:
        names = [n for n in os.listdir(directory) if FILE_PATTERN.match(n)]
    except OSError:
        return []
    written: list[tuple[int, str]] = []
    for name in names:
        try:
            written.append((os.stat(os.path.join(directory, name)).st_mtime_ns, name))
        except OSError:  # deleted meanwhile
            continue
    return [name for _, name in sorted(written)]


def prune(directory: str, keep: int) -> list[str]:
    """Delete the oldest trace files beyond ``keep``; the names deleted."""
    names = trace_files(directory)
    deleted: list[str] = []
    for name in names[: max(0, len(names) - keep)]:
        try:
            os.unlink(os.path.join(directory, name))
            deleted.append(name)
        except OSError:
            pass
    return deleted


def complete(name: str, cat: str, ts_us: float, dur_us: float, tid: int, args: dict | None = None,
             pid: int = 0) -> dict[str, Any]:
    """A complete event (``ph: X``)."""
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": round(ts_us, 3),
                             "dur": round(max(0.0, dur_us), 3), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def names(pid: int, process: str, threads: Iterable[tuple[int, str]]) -> list[dict[str, Any]]:
    """Metadata events naming the process and its threads (tracks)."""
    out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}]
    out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}}
            for tid, label in threads]
    return out
