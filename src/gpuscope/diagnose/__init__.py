"""``gpuscope diagnose``: what is wrong with this box, with the numbers that say so.

Modules, one job each: ``summary`` (what a window of observation boils down to), ``findings`` (what
a verdict is, and every threshold), ``verdicts`` (the patterns, pure functions of a summary),
``process_verdicts`` (the same for each process on a GPU), ``host`` (CPU and memory from /proc),
``gpus`` (every GPU and its processes through the NVML exporter's own code), ``processes`` (the CPU
side of those processes from /proc), ``scrape`` (a server's or vLLM's /metrics), ``live`` (sampling
a window), ``history`` (a past window from Prometheus' recording rules), ``view`` (the terminal
table), ``main`` (the command). docs/diagnose.md describes the verdicts and the exit status.
"""

from gpuscope.diagnose.findings import Finding, Limits
from gpuscope.diagnose.summary import GpuSummary, OpSummary, ProcessSummary, ServerSummary, Summary
from gpuscope.diagnose.verdicts import judge

__all__ = ["Finding", "GpuSummary", "Limits", "OpSummary", "ProcessSummary", "ServerSummary", "Summary",
           "judge"]
