"""Exact per-request figures, kept by gpuscope because Locust rounds them.

Locust stores response times rounded to two significant figures above 100 ms,
too coarse for inter-token latency percentiles. Every Locust process keeps one
:class:`Recorder`; workers ship what they gathered since their last report to
the master with Locust's own stats report (``report_to_master`` /
``worker_report``), so ``--processes`` and ``--master``/``--worker`` runs end
with every request in one file on the master.

The file is JSON::

    {"format": "gpuscope-loadtest-samples/1", "started": <unix s>, "stopped": <unix s>,
     "dropped": 0, "requests": [{"t": <unix s sent>, "tenant": "alpha", "ok": true,
     "ttft": 0.012, "e2e": 0.31, "tokens": 32, "itl": [0.009, ...], "error": null, "cut": false}, ...]}

A ``cut`` request was still streaming when Locust stopped its user: it has no
end-to-end time and is neither a success nor an error, but the tokens it got count.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "gpuscope-loadtest-samples/1"
#: Per-process cap, so a forgotten long run cannot eat the load generator's memory.
MAX_REQUESTS = 500_000


@dataclass
class Recorder:
    """Request records of one process (and, on the master, of all workers)."""

    max_requests: int = MAX_REQUESTS
    requests: list[dict[str, Any]] = field(default_factory=list)
    dropped: int = 0
    started: float | None = None
    stopped: float | None = None
    _shipped: int = 0

    def add(self, t: float, tenant: str, ok: bool, ttft: float | None, e2e: float | None,
            tokens: int, itl: list[float], error: str | None = None, cut: bool = False) -> None:
        """One request; ``cut`` when the run ended while it streamed (what arrived is kept)."""
        if len(self.requests) >= self.max_requests:
            self.dropped += 1
            return
        self.requests.append({"t": t, "tenant": tenant, "ok": ok, "ttft": ttft, "e2e": e2e,
                              "tokens": tokens, "itl": itl, "error": error, "cut": cut})

    def reset(self, now: float) -> None:
        """A new test starts: forget the last one."""
        self.requests.clear()
        self.dropped = 0
        self._shipped = 0
        self.started, self.stopped = now, None

    def take_unshipped(self) -> dict[str, Any]:
        """Records added since the last call, for a worker's report to the master."""
        batch = self.requests[self._shipped:]
        self._shipped = len(self.requests)
        dropped, self.dropped = self.dropped, 0
        return {"requests": batch, "dropped": dropped}

    def merge(self, batch: dict[str, Any]) -> None:
        """Fold a worker's batch into the master's records."""
        room = self.max_requests - len(self.requests)
        incoming = batch.get("requests", [])
        self.requests.extend(incoming[:max(room, 0)])
        self.dropped += int(batch.get("dropped", 0)) + max(len(incoming) - max(room, 0), 0)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "started": self.started, "stopped": self.stopped,
                "dropped": self.dropped, "requests": self.requests}

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write atomically, so a reader never sees half a file."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")))
        tmp.replace(target)


def load_samples(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a samples file; raises ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read samples ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a gpuscope samples file (format {FORMAT})")
    return data
