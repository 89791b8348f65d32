"""Knowing, at no cost per region, whether a CUDA graph is being captured.

Asking CUDA (``torch.cuda.is_current_stream_capturing()``) on every region would
put one more torch call on every region's hot path (its cost: docs/design.md,
"CPU cost of one call"), so the timer keeps a process-wide count of captures in
progress, maintained by wrapping
``torch.cuda.CUDAGraph.capture_begin``/``capture_end`` (which
``torch.cuda.graph`` and ``make_graphed_callables`` use). Only while a capture
is in progress does the hot path ask CUDA which stream is capturing. A capture
started outside torch is not seen here; an event recorded into it then fails to
resolve and is counted as an ``error`` drop: the capture itself stays intact.
"""

from __future__ import annotations

import functools
import threading

#: captures in progress in this process; a one-element list so the hot path reads it without a call
in_progress = [0]
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Wrap torch's CUDAGraph capture methods once per process (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        import torch

        graph_class = torch.cuda.CUDAGraph
        begin, end = graph_class.capture_begin, graph_class.capture_end

        @functools.wraps(begin)
        def capture_begin(self, *args, **kwargs):
            begin(self, *args, **kwargs)
            with _lock:
                in_progress[0] += 1

        @functools.wraps(end)
        def capture_end(self, *args, **kwargs):
            try:
                return end(self, *args, **kwargs)
            finally:
                with _lock:
                    in_progress[0] = max(0, in_progress[0] - 1)

        graph_class.capture_begin = capture_begin
        graph_class.capture_end = capture_end
        _installed = True
