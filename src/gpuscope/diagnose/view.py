"""The terminal view: a table of the latest readings with a progress bar, and the verdict text.

Plain text and ANSI only (no curses, no dependency): on a terminal the table is redrawn in place
each second; into a pipe or file only the final table and the verdict are written.
"""

from __future__ import annotations

from gpuscope.diagnose.live import Window
from gpuscope.diagnose.summary import Summary
from gpuscope.diagnose.verdicts import Finding

CLEAR = "\x1b[H\x1b[2J"


def pct(value: float | None) -> str:
    return "   -" if value is None else f"{value * 100:3.0f}%"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


def bar(share: float, width: int = 30) -> str:
    done = round(share * width)
    return "[" + "#" * done + "." * (width - done) + f"] {share * 100:3.0f}%"


def table(summary: Summary) -> str:
    """Host, every GPU and the server, as columns a person scans in a second."""
    lines = [f"host {summary.host or '-'}   CPU {pct(summary.cpu)}   busiest core "
             f"{pct(summary.cpu_busiest_core)}   RAM {pct(summary.ram_used_ratio)}   window "
             f"{summary.window_s:.0f}s ({summary.source})", ""]
    if summary.gpus:
        lines.append(f"{'GPU':>6} {'util':>5} {'min-max':>9} {'memory':>7} {'SM MHz':>7} {'power W':>12} "
                     "throttle / XID")
        for g in summary.gpus:
            span = "-" if g.util_min is None else f"{g.util_min * 100:.0f}-{(g.util_max or 0) * 100:.0f}%"
            power = "-" if g.power_w is None else f"{g.power_w:.0f}/{g.power_limit_w or 0:.0f}"
            flags = [f"{r} {v * 100:.0f}%" for r, v in g.clock_events.items() if v > 0 and r != "gpu_idle"]
            flags += [f"XID {c} x{n:.0f}" for c, n in g.xids.items()]
            clock = "-" if g.sm_clock_hz is None else f"{g.sm_clock_hz / 1e6:.0f}"
            lines.append(f"{g.label:>6} {pct(g.util_mean):>5} {span:>9} {pct(g.memory_used_ratio):>7} "
                         f"{clock:>7} {power:>12} {', '.join(flags) or '-'}")
    if summary.processes:
        lines += ["", *processes(summary)]
    srv = summary.server
    if srv is not None:
        num = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
        lines += ["", f"server ({srv.source}): running {num(srv.running)}  waiting {num(srv.waiting)}  "
                      f"KV cache max {pct(srv.kv_cache_max)}  preemptions {num(srv.preemptions, '{:.0f}')}  "
                      f"tokens/s {num(srv.tokens_per_s)}",
                  f"  TTFT p50 {ms(srv.ttft_p50_s)} p99 {ms(srv.ttft_p99_s)}   ITL p50 {ms(srv.itl_p50_s)} "
                  f"p99 {ms(srv.itl_p99_s)}   queue p50 {ms(srv.queue_p50_s)}"]
        measured = [(op, o) for op, o in srv.ops.items() if o.p50_s is not None or o.busy_ratio is not None]
        ops = sorted(measured, key=lambda kv: -(kv[1].p50_s or 0))[:8]
        if ops:
            lines.append(f"  {'op':<40} {'p50':>10} {'busy':>5}")
            lines += [f"  {op[:40]:<40} {ms(o.p50_s):>10} {pct(o.busy_ratio):>5}" for op, o in ops]
    for what in summary.unavailable:
        lines.append(f"(not available: {what})")
    return "\n".join(lines)


def short_command(command: str, width: int = 60) -> str:
    """The interpreter's name without its folder, and the middle elided: the script and its last
    arguments are what tell one job from another."""
    head, _, rest = command.partition(" ")
    text = f"{head.rsplit('/', 1)[-1]} {rest}".strip()
    if len(text) <= width:
        return text
    keep = width // 3
    return text[:keep] + "..." + text[-(width - keep - 3):]


def processes(summary: Summary) -> list[str]:
    """One line per process on a GPU: its GPU side (NVML) beside its CPU side (/proc), in cores' %."""
    lines = [f"{'pid':>8} {'GPU':>5} {'memory':>9} {'SM':>4} {'CPU':>5} {'busiest thread':<26} "
             f"{'workers':<12} command"]
    for p in summary.processes:
        memory = "-" if p.memory_bytes is None else f"{p.memory_bytes / 2**30:.1f} GiB"
        t = p.busiest_thread
        thread = "-" if t is None else f"{t.id} {t.name[:12]} {t.cpu * 100:.0f}%"
        busy = [w for w in p.workers if w.cpu > 0]
        workers = f"{len(busy)} at {sum(w.cpu for w in busy) * 100:.0f}%" if busy else "-"
        lines.append(f"{p.pid:>8} {','.join(p.gpus)[:5]:>5} {memory:>9} {pct(p.sm_util):>4} {pct(p.cpu):>5} "
                     f"{thread:<26} {workers:<12} {short_command(p.command)}")
    return lines


def live_frame(window: Window, share: float, host: str) -> str:
    return f"{CLEAR}gpuscope diagnose   sampling {bar(share)}\n\n{table(window.summary(host))}\n"


def verdict(findings: list[Finding]) -> str:
    if not findings:
        return "verdict: no problem found in this window.\n"
    out = [f"verdict: {sum(f.severity == 'problem' for f in findings)} problem(s), "
           f"{sum(f.severity == 'warning' for f in findings)} warning(s)"]
    for f in findings:
        where = f" [{f.where}]" if f.where else ""
        out.append(f"\n{f.severity.upper()} {f.code}{where}: {f.title}")
        out.append("  because " + ", ".join(f"{k}={v}" for k, v in f.evidence.items()))
        out.append(f"  next: {f.next_step}")
    return "\n".join(out) + "\n"
