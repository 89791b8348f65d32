"""The one commented configuration of gpuscope's alerts: selectors, thresholds, windows, links.

Everything a rule or Alertmanager route needs to know about the world lives here; the rule
modules only turn it into PromQL/LogQL. Two profiles come from the same source:

- ``PRODUCTION``: what users run (``alerts/prometheus/production/``, ``alerts/alertmanager.yml``);
- ``TEST``: the same rules and thresholds with every window compressed by ``TEST_COMPRESSION``
  (floored at ``TEST_MIN_WINDOW_S``), so that an end-to-end run with injected faults sees each alert
  within a minute or two (``alerts/prometheus/test/``, ``alerts/alertmanager-test-profile.yml``).

Durations are in seconds. After changing anything, regenerate:
``gpuscope generate`` (tests fail on a stale file).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from gpuscope.contract import parts


@dataclass(frozen=True)
class Selectors:
    """PromQL/LogQL label matchers that pick each part of the stack (the job names of its scrape config).

    ``server``, ``exporter``, ``vllm`` and ``dcgm`` pick the targets of each source (``sources.py``);
    only the layers of ``Profile.sources`` read them. An equality matcher on ``job`` also names the job
    in the "no target at all" alerts.
    """

    server: str = f'job="{parts.SERVER.job}"'
    exporter: str = f'job="{parts.EXPORTER.job}"'
    vllm: str = f'job="{parts.VLLM.job}"'
    dcgm: str = f'job="{parts.DCGM_EXPORTER.job}"'
    share: str = f'job="{parts.SHARE.job}"'
    node: str = f'job="{parts.NODE_EXPORTER.job}"'
    #: Loki stream selector of the server's logs (its only stream labels are service and instance).
    server_logs: str = f'service="{parts.SERVER.service}"'
    #: kube-state-metrics' desired replica count of the workload behind each role's targets (the shipped
    #: manifests' Deployment and DaemonSet, deploy/kubernetes/base; kube-state-metrics
    #: internal/store/deployment.go and daemonset.go, v2). Where the series exist, targets that left
    #: together with the desired count (an HPA scale-down, a GPU node removed) are not missing.
    server_desired: str = f'kube_deployment_spec_replicas{{deployment="{parts.SERVER.service}"}}'
    exporter_desired: str = ("kube_daemonset_status_desired_number_scheduled"
                             f'{{daemonset="{parts.EXPORTER.service}"}}')
    #: Value of the ``service`` label every alert carries, which the Alertmanager routes match on: the
    #: role (inference server, GPU exporter), whichever source plays it.
    server_service: str = parts.SERVER.service
    exporter_service: str = parts.EXPORTER.service


@dataclass(frozen=True)
class Thresholds:
    """Thresholds: identical in both profiles, so the test profile proves the production numbers."""

    # Latency spikes: short-window p99 at least this many times the baseline p99 of the same op/endpoint.
    latency_spike_ratio: float = 3.0
    # Minimum traffic before a p99 may page: with ≥ 1 sample/s over a 5 m window, p99 ignores the
    # slowest 3 of ≥ 300 samples, so one slow kernel or request cannot raise it.
    kernel_min_samples_per_s: float = 1.0
    request_min_requests_per_s: float = 0.5
    # Queue wait near zero makes ratios meaningless (1 ms → 4 ms is "4×"): also require this p99.
    queue_wait_min_p99_s: float = 0.5

    # SLOs (multi-window multi-burn-rate, SRE workbook ch. 5). The latency objective must be a bucket
    # boundary of the TTFT histogram (checked below), so "good" is read straight from one bucket.
    slo_ttft_objective_s: float = 1.0
    slo_ttft_target: float = 0.99
    slo_availability_target: float = 0.999
    #: Request outcomes that spend the availability budget (abort is the client's choice, not ours).
    slo_bad_outcomes: tuple[str, ...] = ("error", "rejected")
    #: Burn-rate factors: page at 14.4× (2% of a 30-day budget in 1 h) or 6× (5% in 6 h); ticket at 1×.
    slo_page_fast_burn: float = 14.4
    slo_page_slow_burn: float = 6.0
    slo_ticket_burn: float = 1.0

    # Memory leaks (the reasoning is in memory.py). Horizons are not compressed in the test profile:
    # they are sensitivities, not detection delays.
    #: GPUMemoryLeak: at the slowest rate its floor grew over the evidence, memory runs out within this.
    leak_horizon_s: int = 4 * 3600
    #: GPUMemoryLeak: the floor's latest growth is at least this fraction of its growth a span earlier.
    #: Caches that fill up grow ever slower (a warm-up's tail, a creep towards a ceiling); leaks do not.
    leak_min_growth_ratio: float = 0.5
    #: GPUMemoryRunningOut: a climb pages only above every earlier peak of leak_fast_history by this
    #: fraction of capacity (a leak makes new highs; a flushed cache returns to the same peak).
    leak_new_high_ratio: float = 0.02
    #: Memory falling below this fraction of its peak is a restart (or a full flush): the warm-up
    #: guard (leak_fast_min_age) starts again from there.
    leak_restart_ratio: float = 0.25
    #: GPUMemoryRunningOut at any age: memory at least this full and still climbing fast.
    leak_near_full_ratio: float = 0.9

    #: GPUKVCacheExhausted (servers without a memory floor, vLLM): KV cache at least this full while
    #: requests are preempted for lack of it. vLLM runs its cache near full by design; preemption is
    #: what says it is too small.
    kv_cache_full_ratio: float = 0.95

    # Starvation: a tenant with backlog served less than this fraction of its configured GPU share.
    underserved_share_fraction: float = 0.5

    # Health.
    exporter_stale_s: float = 30.0          # cached NVML values older than this are stale
    #: XID codes that mean broken hardware or a lost GPU (NVIDIA's XID catalogue): ECC double-bit (48),
    #: GSP/PMU/firmware errors (61, 62, 119, 120), row remapping events (63, 64), NVLink (74), fallen off
    #: the bus (79), high single-bit ECC rate (92), contained/uncontained ECC (94, 95), GSP fatal (140).
    #: Application faults such as 13, 31 and 43 are left out: they are the workload's bugs, not the GPU.
    xid_critical: tuple[int, ...] = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140)
    #: Clock-event reasons by cause, as regexes, so naming variants (sw_/hw_) of the exporter all match.
    throttle_thermal_reasons: str = ".*thermal.*"
    throttle_power_reasons: str = ".*power.*"
    throttle_ratio: float = 0.5             # throttled more than half of the window
    timer_drop_ratio: float = 0.01          # more than 1% of sampled regions lost their timing

    # Logs (Loki ruler).
    error_log_lines_per_s: float = 0.1      # error lines per second from one server instance
    oom_log_line: str = "CUDA out of memory"

    # Bottleneck classification (recording rules only, for the bottlenecks dashboard).
    #: Host RAM or a GPU's framebuffer this full is the memory_pressure class; a tenant of gpuscope
    #: share holding this much of its memory cap is near it (GPUTenantNearMemoryCap).
    bottleneck_memory_ratio: float = 0.9
    bottleneck_idle_ratio: float = 0.1      # both CPU and GPU below this: idle
    #: An op whose kernels keep the GPU busy less than this share of its region time is launch-bound
    #: (gpuscope serve --timing.kernel-busy; timing/busy.py): CUDA graphs or fewer, larger kernels help.
    launch_bound_busy_ratio: float = 0.5


@dataclass(frozen=True)
class Windows:
    """Windows and ``for`` durations (seconds): the only thing the test profile changes."""

    latency: int = 5 * 60                   # short window of the p99 that is compared
    latency_baseline: int = 24 * 3600       # history whose median p99 is the baseline
    latency_for: int = 10 * 60              # > latency window: one slow request leaves it before this
    slo_short_fast: int = 5 * 60
    slo_long_fast: int = 3600
    slo_short_slow: int = 30 * 60
    slo_long_slow: int = 6 * 3600
    slo_ticket_long: int = 3 * 24 * 3600
    slo_page_for: int = 2 * 60
    slo_ticket_for: int = 3600
    # Memory leaks (memory.py). Slow: the floor (lowest value over leak_floor) must have grown across
    # every leak_step-long interval of the last leak − leak_floor; leak is the whole evidence span.
    leak: int = 75 * 60                     # > the longest healthy ramp (a 60-minute allocate phase)
    leak_floor: int = 15 * 60               # > allocate/free cycles and scrape noise: they leave the floor
    leak_step: int = 20 * 60                # ≥ the period of a leak that grows in steps
    leak_resolution: int = field(default=60, metadata={"test_min_s": 5})  # subquery step of the check
    leak_for: int = 10 * 60                 # the evidence is in the window; this only rides out blips
    # Fast (GPUMemoryRunningOut): the floor over leak_fast_floor grew over leak_fast_step at a rate
    # that exhausts memory within leak_fast_horizon. Unlike leak_horizon_s this is compressed in the
    # test profile: it is what leak_fast_for must stay shorter than. Its two short windows only hold
    # a few samples of min/max (no rate()), so the test profile floors them at 10 s, not 20 s.
    leak_fast_horizon: int = 30 * 60
    leak_fast_floor: int = field(default=60, metadata={"test_min_s": 10})
    leak_fast_step: int = field(default=2 * 60, metadata={"test_min_s": 10})
    leak_fast_for: int = 10 * 60            # > a surge's climb + floor + step; < the exhaustion time
    #: The process has run this long since its last start (the series' age, and no fall to
    #: leak_restart_ratio of its peak within it: a restart keeps the labels): a warm-up is over.
    leak_fast_min_age: int = 30 * 60
    #: History whose highest peak a climb must top by leak_new_high_ratio (peaks before the last
    #: leak_fast_for): longer than the slowest allocate/free cycle (hourly), and across a restart.
    leak_fast_history: int = 3 * 3600
    # Near full (GPUMemoryRunningOut, trigger="near_full"): at any age, memory ≥ leak_near_full_ratio
    # and the growth since the last evaluation exhausts it within leak_near_full_horizon, for
    # leak_near_full_for. A warm-up that plateaus below capacity stops growing within one evaluation;
    # a leak from the first minute does not.
    leak_near_full_horizon: int = 10 * 60
    leak_near_full_for: int = field(default=60, metadata={"test_min_s": 5})
    # Climbing (GPUMemoryRunningOut, trigger="climbing"): at any age, the floor (over leak_fast_floor)
    # grew across every leak_climb_step of the last leak_climb, at a pace that would fill the device
    # from empty in leak_climb_fill_fastest..leak_climb_fill_slowest, and at the slowest interval's
    # growth memory runs out within leak_climb_horizon, for leak_climb_for. It pages a leak that starts
    # with its process (which the warm-up guard hides from ``sustained``) with minutes to spare.
    leak_climb: int = 12 * 60               # > the fast warm-ups' climbs (a load in 10 minutes)
    leak_climb_step: int = field(default=2 * 60, metadata={"test_min_s": 10})
    leak_climb_horizon: int = 10 * 60       # − leak_climb_for − an evaluation ≥ 5 minutes of lead
    leak_climb_for: int = field(default=60, metadata={"test_min_s": 5})
    #: Faster than this fill time is a load (weights, a cache: minutes to near full, then it stops).
    leak_climb_fill_fastest: int = 20 * 60
    #: Slower than this fill time: an allocate phase (an hourly cycle's 25-minute climb) looks the
    #: same until it stops, so it waits for ``sustained``'s settled-process evidence.
    leak_climb_fill_slowest: int = 40 * 60
    starvation: int = 5 * 60                # backlog throughout, and no tokens, over this window
    starvation_for: int = 5 * 60
    #: GPUTenantNearMemoryCap: a tenant holds bottleneck_memory_ratio of its memory cap this long (a
    #: burst of allocations that is freed again within minutes is not a tenant sized at its cap).
    memory_cap_for: int = 5 * 60
    #: The share controller's own flags (a process that never joined, seen in two samples in a row; a
    #: tenant under-reporting over minutes) already hold over time: this only rides out one flip.
    share_flag_for: int = 60
    scrape_down_for: int = 2 * 60
    target_missing: int = 15 * 60           # fewer targets than this long ago: one left discovery
    #: "No target at all" waits until the rules have run this long (longer than a start takes on one
    #: host or in a fleet, and than the 2-minute for; docs/alerts.md, "How to tune"): no pending state
    #: while targets come up. A start is not faster in the test profile, so it keeps two minutes there.
    target_start_grace: int = field(default=5 * 60, metadata={"test_min_s": 120})
    gpus_missing: int = 24 * 3600           # fewer GPUs than the exporter saw within this window
    exporter_stale_for: int = 2 * 60
    gpu_lost_for: int = 60
    xid: int = 15 * 60                      # an XID keeps its alert this long
    throttle: int = 10 * 60
    throttle_for: int = 10 * 60
    timer_drop: int = 10 * 60
    timer_drop_for: int = 10 * 60
    logs: int = 5 * 60
    logs_for: int = 60
    bottleneck: int = 5 * 60

    def compressed(self, factor: int, floor_s: int) -> Windows:
        """Every window divided by ``factor``, at least ``floor_s`` (or the field's own ``test_min_s``)."""
        return replace(self, **{f.name: max(f.metadata.get("test_min_s", floor_s),
                                            getattr(self, f.name) // factor) for f in fields(self)})


@dataclass(frozen=True)
class Notify:
    """Alertmanager timing (seconds) and the receiver."""

    #: ≥ 2 evaluation intervals: a composite evaluated in a later rule group still arrives in time
    #: to inhibit the component that fired at the same evaluation before its group is first sent.
    group_wait: int = 60
    group_interval: int = 5 * 60
    repeat_interval: int = 4 * 3600
    #: The project's alert receiver (`gpuscope receiver`); compose service name and its port. The
    #: no-Docker stack rewrites this one value.
    receiver_url: str = f"http://{parts.RECEIVER.name}:{parts.RECEIVER.port}/alerts"


@dataclass(frozen=True)
class Links:
    """Where runbook and dashboard links in annotations point."""

    #: docs/runbooks.md as served to people reading alerts; each alert links its own section.
    runbook_base: str = "https://github.com/gpuscope/gpuscope/blob/main/docs/runbooks.md"
    grafana: str = f"http://localhost:{parts.GRAFANA.port}"


@dataclass(frozen=True)
class Cost:
    """What the GPUs cost, for the cost-per-token records (``energy.py``)."""

    #: Price of one GPU-hour, in your currency. The default 1 makes the cost records read in GPU-hours
    #: per million output tokens until a price is set.
    gpu_hour: float = 1.0

    def __post_init__(self) -> None:
        if not self.gpu_hour > 0:
            raise ValueError(f"cost.gpu_hour must be a positive price, not {self.gpu_hour!r}")


#: The sources whose metrics the rules read (``sources.py``): a server (``gpuscope-server`` or ``vllm``)
#: and a GPU exporter (``gpuscope-exporter`` or ``dcgm-exporter``), several of one role where both run.
#: ``alerts/prometheus/<profile>/sources.rules.yml`` is their normalisation layer; every source's layer is
#: also written on its own under ``alerts/sources/<profile>/`` for another choice at deploy time.
DEFAULT_SOURCES: tuple[str, ...] = (parts.SERVER.job, parts.EXPORTER.job)


@dataclass(frozen=True)
class Profile:
    """One complete alerting configuration."""

    name: str
    evaluation_interval: int
    windows: Windows
    notify: Notify
    sources: tuple[str, ...] = DEFAULT_SOURCES
    selectors: Selectors = field(default_factory=Selectors)
    thresholds: Thresholds = field(default_factory=Thresholds)
    links: Links = field(default_factory=Links)
    cost: Cost = field(default_factory=Cost)


#: Test-profile compression: 5 m → 20 s, 1 h → 4 m, 1 d → 96 m.
TEST_COMPRESSION = 15
#: Shortest test window: 4 scrapes at the stack's 5 s scrape interval, so rate() always has samples.
#: A window no rate() reads may set a lower one (field metadata ``test_min_s``).
TEST_MIN_WINDOW_S = 20

PRODUCTION = Profile(name="production", evaluation_interval=30, windows=Windows(), notify=Notify())
TEST = Profile(
    name="test",
    evaluation_interval=5,
    windows=Windows().compressed(TEST_COMPRESSION, TEST_MIN_WINDOW_S),
    # group_wait at its floor (two evaluation intervals): every second of it is detection latency.
    notify=Notify(group_wait=10, group_interval=30, repeat_interval=3600),
)
PROFILES: dict[str, Profile] = {p.name: p for p in (PRODUCTION, TEST)}
