"""Loki ruler rules (LogQL, in the Prometheus rule format) on the server's logs.

Kept deliberately plain (a stream selector, one line filter or the json parser, one range
aggregation) so Grafana's LogQL grammar (tools/logql) accepts them and anyone can read them. The
server's log stream labels are only ``service`` and ``instance``; with ``auth_enabled: false`` Loki
reads the rule file from the ruler directory of tenant ``fake``.
"""

from __future__ import annotations

from gpuscope.alerting.rules import Alert, Doc, Group
from gpuscope.contract import uids
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import duration, num

LABELS = "service, instance"


def groups(p: Profile) -> list[Group]:
    s, t, w = p.selectors, p.thresholds, p.windows
    window = duration(w.logs)
    stream = f"{{{s.server_logs}}}"
    common = {"service": s.server_service, "dashboard": uids.LOGS}
    alerts = (
        Alert(name="GPUServerCUDAOutOfMemory",
              expr=f'sum by ({LABELS}) (count_over_time({stream} |= "{t.oom_log_line}" [{window}])) > 0',
              for_s=0, severity="warning", **common,
              summary="CUDA out of memory on {{ $labels.instance }}",
              description=(f"{{{{ $labels.instance }}}} logged {{{{ $value }}}} \"{t.oom_log_line}\" "
                           f"line(s) in the last {window}: requests are failing for lack of GPU memory."),
              doc=Doc(what="Out-of-memory errors in the server's logs", threshold="any line",
                      window=window,
                      why="Each OOM is a failed request; the log line says which allocation failed, "
                          "which metrics cannot.")),
        Alert(name="GPUServerErrorLogBurst",
              expr=(f'sum by ({LABELS}) (rate({stream} | json | level="error" [{window}])) '
                    f"> {num(t.error_log_lines_per_s)}"),
              for_s=w.logs_for, severity="warning", **common,
              summary="Burst of error logs on {{ $labels.instance }}",
              description=(f"{{{{ $labels.instance }}}} logs {{{{ $value | humanize }}}} error lines per "
                           f"second over {window}."),
              doc=Doc(what="Error-level log lines from the server",
                      threshold=f"> {num(t.error_log_lines_per_s)} lines/s",
                      window=f"{window}, for {duration(w.logs_for)}",
                      why="Catches failures that do not reach the request metrics (background "
                          "threads, the log shipper, start-up).")),
    )
    return [Group("gpuscope-logs", alerts)]
