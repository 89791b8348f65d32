"""The settings of ``gpuscope share``: each flag and its default declared once, read as they are by
the command (main.py) and the controller (controller.py), enums staying enums."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from gpuscope.contract.choices import Choice
from gpuscope.contract.parts import LOCAL_HOST, SHARE_PORT
from gpuscope.share.access import Rule, parse_allow
from gpuscope.share.gpus import ALL, parse_gpus
from gpuscope.share.ledger import (
    DEFAULT_BESIDE_QUEUE_US,
    DEFAULT_QUEUED_WINDOWS,
    DEFAULT_WINDOW_US,
    TenantPolicy,
)
from gpuscope.share.policy import check_name, parse_shares
from gpuscope.share.preload import DEFAULT_LEDGER
from gpuscope.util.bounded_http import max_connections_setting, read_timeout_setting
from gpuscope.util.flags import listen_address, parse_duration
from gpuscope.util.settings import parse_float, setting

#: The turn of the smallest share while shares bind (``--share.slice``). Each hand-over wakes the
#: controller and both tenants' helper threads, so shorter turns cost CPU without holding shares any
#: closer (docs/share.md, "Turn length against CPU"). A tenant of equal priority waits up to the
#: other's turn: latency tenants get a priority.
DEFAULT_SLICE_S = 0.03
#: A tenant beside the holder launches untimed (an event between its small kernels costs it a context
#: switch each on a time-sliced GPU: docs/share.md, "Priorities"). Every PROBE_EVERY_S one active
#: tenant runs alone, first for PROBE_LEAD_S as it launches anyway (its launches a second and its
#: waits for the GPU alone, which its estimated throughput beside the holder is read against), then
#: for PROBE_S timing each launch: its busy fraction, which decides whether it takes turns or runs
#: beside the holder, and what it is charged there. A tenant's first probe comes PROBE_FIRST_S after
#: it starts; a probe's windows are read PROBE_READ_LAG_S after it (the helper posts in batches).
PROBE_EVERY_S, PROBE_S, PROBE_FIRST_S, PROBE_READ_LAG_S = 1.0, 0.02, 0.2, 0.01
PROBE_LEAD_S = 0.01
#: While tenants take turns the hand-overs run in C (``_turns``), and the controller's Python loop takes
#: control back this often to charge posted time, update the active set and start probes (the C loop
#: itself returns at once when a tenant process exits or rings). Each return costs a wake-up of the
#: interpreter on a cold cache, as each hand-over did when they were decided in Python (docs/share.md,
#: "The turn keeper"): at 0.25 s the controller took 0.22-0.38% of a core on the CPU host's fake GPU,
#: at 0.5 s 0.13-0.25%, with the same shares, iterations and latency.
KEEPER_RETURN_S = 0.5
#: A tenant whose probes agree is probed up to this many times less often (docs/share.md, "Probes").
DEFAULT_PROBE_BACKOFF = 8


def parse_gangs(text: str) -> tuple[str, ...]:
    """``NAME,...``: tenants held as one group across GPUs."""
    return tuple(check_name(name.strip()) for name in str(text).split(",") if name.strip())


#: What ``--share.starved-below`` suggests: a tenant beside the holder at under three quarters of its
#: fair share of its alone throughput takes turns (``SliceScheduler.starved``).
SUGGESTED_STARVED_BELOW = 0.75
#: How long a tenant found starved beside the holder takes turns before its probes may put it beside
#: again (the tenants beside it may have changed), for another look.
STARVED_TURNS_S = 30.0


def parse_starved_below(text: str) -> float:
    """``--share.starved-below``: a fraction in [0, 1); 0 leaves every tenant where its probes put it."""
    value = parse_float(text)
    if not 0 <= value < 1:
        raise ValueError(f"{text!r} is not a fraction of the fair share in [0, 1) (0: off)")
    return value


class Accounting(Choice):
    """``--share.accounting``: what a tenant's GPU time is charged from."""

    EVENTS = "events"
    NVML = "nvml"


class Handover(Choice):
    """``--share.handover``: how the GPU passes from one slice holder to the next."""

    OVERLAP = "overlap"
    DRAIN = "drain"


class Turns(Choice):
    """``--share.turns``: where hand-overs between slice holders are decided."""

    C = "c"
    PYTHON = "python"


class LoneHolder(Choice):
    """``--share.lone-holder``: what holds the one tenant taking turns while every other runs beside it."""

    HOLD = "hold"
    DUTY = "duty"


class PriorityHold(Choice):
    """``--share.priority-hold``: whether a burst of a tenant of higher priority beside the slice holder
    holds the holder's launches until it ends."""

    ON = "on"
    OFF = "off"


#: A burst of launches of a tenant of higher priority holds the slice holder for at most this long (a
#: program that never waits for the GPU would hold it for ever), and the bursts together for at most
#: that tenant's share of the time, with up to HOLD_CREDIT_S saved up (``_turns.c`` takes both as
#: arguments).
HOLD_MAX_S, HOLD_CREDIT_S = 0.02, 0.1


@dataclass(frozen=True)
class ShareSettings:
    """The flags of ``gpuscope share``."""

    shares: list[TenantPolicy] | None = setting(
        "--share", None, "tenants, their shares, priorities and memory caps: "
        "NAME=FRACTION[:PRIORITY[:MEMORY]],... (higher priority first; MEMORY a fraction of the card such as "
        "0.4, or a size such as 40GiB)",
        parse=parse_shares)
    accounting: Accounting = setting(
        "--share.accounting", Accounting.EVENTS, "events: slices charged by the tenants' CUDA events; nvml: "
        "token buckets fed by NVML utilization every 100 ms (what the peer projects do)")
    policy_file: str = setting(
        "--share.policy-file", "", "a YAML file of the tenants (shares, priorities, memory caps, admission "
        "rules, gangs; sections for GPUs whose tenants differ) instead of --share, --share.allow and "
        "--share.gang; a change is applied within half a second (or at SIGHUP), after validation, without "
        "restarting anything")
    ledger: str = setting("--share.ledger", DEFAULT_LEDGER, "path prefix of the shared-memory ledger "
                          "(tenants set GPUSCOPE_SHARE_LEDGER to it)")
    slice: float = setting("--share.slice", DEFAULT_SLICE_S, "length of one tenant's turn while shares bind",
                           parse=parse_duration)
    handover: Handover = setting(
        "--share.handover", Handover.DRAIN, "drain: the next holder starts once the previous one's queued "
        "work is done (the holder stops at its slice's end by itself and drains; exact shares); overlap: the "
        "next holder starts at once, beside that work, and the overlap is split between them (the two "
        "contexts' time-slicing then costs the smaller share more)")
    turns: Turns = setting(
        "--share.turns", Turns.C, "where hand-overs are decided: c (a loop in C that wakes "
        f"Python only every {KEEPER_RETURN_S * 1e3:g} ms; python where it was not built) or python (a "
        "wake-up of the Python loop per hand-over)")
    drain_timeout: float = setting("--share.drain-timeout", 0.2, "longest wait for a holder's queued work "
                                   "before a drain hand-over or a probe", parse=parse_duration)
    probe_every: float = setting(
        "--share.probe-every", PROBE_EVERY_S, "how often one tenant, in turn, is probed (the others paused "
        f"for {(PROBE_LEAD_S + PROBE_S) * 1e3:g} ms while it runs alone, the last {PROBE_S * 1e3:g} "
        "timing each launch) for its busy fraction: whether it takes turns or runs beside the holder, "
        "and what it is charged there; longer costs less CPU and paused time, "
        "shorter follows a changing workload sooner",
        parse=parse_duration)
    probe_backoff: int = setting(
        "--share.probe-backoff", DEFAULT_PROBE_BACKOFF, "a tenant whose probes agree with its estimate is "
        "probed half as often after each, up to this many times less often than every tenant in turn; a "
        "probe that moves its estimate, or a pause in its work, brings it back (1: every tenant in turn, "
        "always)")
    starved_below: float = setting(
        "--share.starved-below", 0.0, "move a tenant running beside the slice holder (one its probes found "
        "idle most of the time, of the lowest priority among those active) to taking turns for "
        f"{STARVED_TURNS_S:g} s when its estimated throughput there (from the part of its time it waits for "
        "the GPU and, where it waits more than alone, its launches a second, against the same alone in its "
        "probes: the lesser) is under this fraction of its fair share, such as "
        f"{SUGGESTED_STARVED_BELOW:g}; taking turns it is charged its holding time. For a launch-bound loop "
        "that syncs at every short step and waits behind a GPU-bound holder at each. Off (0) by default: "
        "on an H100 it never fired in the mixes measured (docs/share.md)",
        parse=parse_starved_below)
    lone_holder: LoneHolder = setting(
        "--share.lone-holder", LoneHolder.HOLD, "the one tenant taking turns while every other active tenant "
        "runs beside it (their probes found them idle most of the time) has nobody to hand the GPU to. "
        "hold: it holds the GPU whenever it launches, and the others get what the GPU's time-slicing gives "
        "them beside it; duty: while their probed demand and its own are more than the GPU, it launches "
        "only in its part of every 10 ms (the time the others leave, at least its share), with a short "
        "queue, and the others run alone for the rest")
    priority_hold: PriorityHold = setting(
        "--share.priority-hold", PriorityHold.OFF, "on: while a tenant of higher priority than the slice "
        "holder runs beside it (a latency tenant), each of its bursts of launches (from its first launch to "
        "its next wait for the GPU) holds the holder's next launches, so that its requests run alone once "
        "the holder's short queue (--share.beside-queue) has finished: on a GPU that time-slices the "
        "contexts they otherwise wait for the holder's time slices at each gap between their kernels. A "
        f"burst holds for at most {HOLD_MAX_S * 1e3:g} ms, and all of a tenant's bursts for at most its "
        "share of the time. off: the holder keeps launching beside it")
    window: float = setting("--share.window", DEFAULT_WINDOW_US / 1e6, "GPU time one accounting window aims "
                            "at (two CUDA events per window)", parse=parse_duration)
    queued_windows: int = setting("--share.queued-windows", DEFAULT_QUEUED_WINDOWS, "finished-but-unresolved "
                                  "windows a slice holder may have queued: bounds the work a hand-over "
                                  "overlaps or waits for")
    beside_queue: float = setting(
        "--share.beside-queue", DEFAULT_BESIDE_QUEUE_US / 1e6, "GPU time a slice holder may keep queued "
        "while a tenant of higher priority (a latency tenant) runs beside it, in windows of 250 us, at least "
        "two: each of that tenant's requests waits behind the holder's queue. Beside a tenant of equal or "
        "lower priority the holder keeps its usual queue (on a GPU that time-slices the tenants' contexts "
        "a short queue idled the holder more than it sped a launch-bound tenant). 0, or as long as the "
        "usual queue (--share.queued-windows of --share.window) or longer: the usual queue always",
        parse=partial(parse_duration, allow_zero=True))
    gpus: str | tuple[int | str, ...] = setting(
        "--share.gpus", ALL, "the GPUs held, each with a ledger, shares and caps of its own: all (every GPU "
        "NVML lists), or NVML indices such as 0,1, or UUIDs (GPU-..., a MIG instance's MIG-...); a tenant "
        "process is held on each GPU it uses by that "
        "GPU's shares (one GPU, whichever each process uses, where NVML cannot be read)", parse=parse_gpus)
    gangs: tuple[str, ...] = setting(
        "--share.gang", (), "tenants that are one group across GPUs (the ranks of a job that runs "
        "collectives): NAME,...; a gang's turns are granted on all its GPUs at once, so a rank never waits "
        "for a turn while its peers hold theirs", parse=parse_gangs)
    watch_interval: float = setting(
        "--share.watch-interval", 0.25, "how often NVML's list of the GPU's processes is compared with the "
        "ones that joined after a change (a process seen twice without joining is reported); up to 4 times "
        "less often while the list stays the same", parse=parse_duration)
    allow: dict[str, tuple[Rule, ...]] | None = setting(
        "--share.allow", None, "which processes may join as which tenant: NAME=RULE[|RULE...],... with rules "
        "uid:N, user:NAME, gid:N, group:NAME, cgroup:PATH, any (a tenant not named: the controller's own "
        "user only)", parse=parse_allow)
    listen: str = setting("--web.listen-address", f"{LOCAL_HOST}:{SHARE_PORT}", "HOST:PORT for /metrics",
                          parse=listen_address, metavar="HOST:PORT")
    max_connections: int = max_connections_setting()
    read_timeout: float = read_timeout_setting()
