"""``gpuscope diagnose``: what is wrong with this box, with the numbers that say so.

Modules, one job each: ``summary`` (what a window of observation boils down to), ``verdicts`` (the
patterns, pure functions of a summary), ``host`` (CPU and memory from /proc), ``gpus`` (every GPU
through the NVML exporter's own code), ``scrape`` (a server's or vLLM's /metrics), ``live`` (sampling
a window), ``history`` (a past window from Prometheus' recording rules), ``view`` (the terminal
table), ``main`` (the command). docs/diagnose.md describes the verdicts and the exit status.
"""

from gpuscope.diagnose.summary import GpuSummary, OpSummary, ServerSummary, Summary
from gpuscope.diagnose.verdicts import Finding, judge

__all__ = ["Finding", "GpuSummary", "OpSummary", "ServerSummary", "Summary", "judge"]
