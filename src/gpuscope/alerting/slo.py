"""SLO burn-rate alerts (SRE workbook, multi-window multi-burn-rate) on TTFT and availability.

Burn rate = bad fraction over a window / error budget (1 − target). Page when both a long and a
short window burn fast (the short one makes the alert resolve soon after the problem stops); open a
ticket when the budget burns faster than it refills over days. Recorded per job (the service), with
the window in a ``window`` label, so dashboards read the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuscope.alerting.rules import Alert, Doc, Group, Record
from gpuscope.contract import catalogue as m
from gpuscope.contract import names, uids
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import duration, le, num

if TYPE_CHECKING:
    from gpuscope.alerting.sources import Raw

LABELS = "job"


def _budget(target: float) -> str:
    return num(round(1.0 - target, 12))


def _windows(p: Profile) -> list[int]:
    w = p.windows
    return sorted({w.slo_short_fast, w.slo_long_fast, w.slo_short_slow, w.slo_long_slow, w.slo_ticket_long})


def ttft_objective_bucket(p: Profile) -> str:
    """The ``le`` of the TTFT bucket that is the objective; it must be one of the catalogue's buckets
    (vLLM's TTFT buckets, which gpuscope serve shares)."""
    objective = p.thresholds.slo_ttft_objective_s
    if objective not in (m.REQUEST_TTFT.buckets or ()):
        raise ValueError(f"TTFT objective {objective}s is not a bucket of {m.REQUEST_TTFT.name}")
    return le(objective)


def source_records(p: Profile, selector: str, ttft: Raw, requests: Raw) -> list[Record]:
    """A source's SLO inputs per window: good and total TTFT requests, bad and total finished requests."""
    bad = f'outcome=~"{"|".join(p.thresholds.slo_bad_outcomes)}"'
    series = {
        names.SLO_TTFT_GOOD: ttft.selector(selector, "_bucket", f'le="{ttft_objective_bucket(p)}"'),
        names.SLO_TTFT_TOTAL: ttft.selector(selector, "_count"),
        names.SLO_AVAILABILITY_BAD: requests.selector(selector, "", bad),
        names.SLO_AVAILABILITY_TOTAL: requests.selector(selector),
    }
    return [Record(record, f"sum by ({LABELS}) (rate({expr}[{duration(seconds)}]))",
                   {"window": duration(seconds)})
            for seconds in _windows(p) for record, expr in series.items()]


def _records(p: Profile) -> list[Record]:
    t = p.thresholds
    return [
        Record(names.SLO_TTFT_BURN_RATE,
               f"(1 - {names.SLO_TTFT_GOOD} / {names.SLO_TTFT_TOTAL})\n/ {_budget(t.slo_ttft_target)}"),
        Record(names.SLO_AVAILABILITY_BURN_RATE,
               f"{names.SLO_AVAILABILITY_BAD} / {names.SLO_AVAILABILITY_TOTAL}\n"
               f"/ {_budget(t.slo_availability_target)}"),
    ]


def _pair(record: str, long: int, short: int, factor: float) -> str:
    f = num(factor)
    return (f'{record}{{window="{duration(long)}"}} > {f}\n'
            f'and ignoring (window)\n{record}{{window="{duration(short)}"}} > {f}')


def _alerts(p: Profile, name: str, record: str, objective: str) -> list[Alert]:
    t, w = p.thresholds, p.windows
    fast = (w.slo_long_fast, w.slo_short_fast, t.slo_page_fast_burn)
    slow = (w.slo_long_slow, w.slo_short_slow, t.slo_page_slow_burn)
    ticket = (w.slo_ticket_long, w.slo_long_slow, t.slo_ticket_burn)
    page_rule = (f"{num(fast[2])}× over {duration(fast[0])} and {duration(fast[1])}, or "
                 f"{num(slow[2])}× over {duration(slow[0])} and {duration(slow[1])}")
    ticket_rule = f"{num(ticket[2])}× over {duration(ticket[0])} and {duration(ticket[1])}"
    page_expr = ("max without (window) (\n  (" + _pair(record, *fast).replace("\n", "\n   ") + ")\n"
                 "  or ignoring (window)\n  (" + _pair(record, *slow).replace("\n", "\n   ") + ")\n)")
    ticket_expr = "max without (window) (\n" + _pair(record, *ticket) + "\n)"
    common = {"name": name, "service": p.selectors.server_service, "dashboard": uids.SLO,
              "dashboard_vars": ()}
    return [
        Alert(**common, expr=page_expr, for_s=w.slo_page_for, severity="critical", evidence_s=fast[0],
              summary=f"{{{{ $labels.job }}}} burns its {objective} error budget fast",
              description=(f"{{{{ $labels.job }}}} burns the error budget of its objective ({objective}) at "
                           f"{{{{ $value | humanize }}}}× the sustainable rate (pages at {page_rule})."),
              doc=Doc(what=f"Error budget of {objective} burning fast (page)", threshold=page_rule,
                      window=f"for {duration(w.slo_page_for)}",
                      why="SRE workbook: 2% of a 30-day budget in 1 h, or 5% in 6 h; the short window "
                          "lets the page resolve soon after the problem stops.")),
        Alert(**common, expr=ticket_expr, for_s=w.slo_ticket_for, severity="warning", evidence_s=ticket[0],
              summary=f"{{{{ $labels.job }}}} spends its {objective} error budget too fast",
              description=(f"{{{{ $labels.job }}}} burns the error budget of its objective ({objective}) at "
                           f"{{{{ $value | humanize }}}}× the sustainable rate ({ticket_rule}): the budget "
                           f"will not last the period."),
              doc=Doc(what=f"Error budget of {objective} burning slowly but steadily (ticket)",
                      threshold=ticket_rule, window=f"for {duration(w.slo_ticket_for)}",
                      why="A slow leak of budget no page catches; fix it in working hours.")),
    ]


def groups(p: Profile) -> list[Group]:
    t = p.thresholds
    ttft_obj = (f"{num(t.slo_ttft_target * 100)}% of requests with TTFT ≤ "
                f"{num(t.slo_ttft_objective_s)}s")
    avail_obj = (f"{num(t.slo_availability_target * 100)}% of requests without "
                 f"{' or '.join(t.slo_bad_outcomes)}")
    alerts = [*_alerts(p, "GPUServiceLatencyBudgetBurn", names.SLO_TTFT_BURN_RATE, ttft_obj),
              *_alerts(p, "GPUServiceErrorBudgetBurn", names.SLO_AVAILABILITY_BURN_RATE, avail_obj)]
    return [Group("gpuscope-slo", (*_records(p), *alerts))]
