"""Server configuration, declared and validated in one place.

``ServerConfig`` holds every setting of ``gpuscope serve``: each field that is a flag says so
(:func:`gpuscope.util.settings.setting`), and ``main`` builds the parser from it. ``parse_tenants``
turns ``--tenants "alpha:0.7:high,beta:0.3:low"`` into ``TenantSpec`` objects.
Every check raises ``ConfigError`` with one readable line, which ``main``
prints before exiting with status 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gpuscope.contract.choices import Choice, MetricNames
from gpuscope.contract.parts import default_listen_address
from gpuscope.contract.tenants import NAME_RULE, valid_tenant_name
from gpuscope.util.flags import parse_listen_address
from gpuscope.util.settings import LogLevel, group, parse_float, setting

from .http_settings import HttpLimits
from .profile.config import ProfileConfig

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
#: The tenant that ``--tenants.unknown other`` sends unknown X-Tenant values to.
OTHER = "other"


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line naming the setting."""


class SchedulerMode(Choice):
    """``--scheduler``: GPU-time shares with priorities, or first come first served."""

    SHARE = "share"
    FCFS = "fcfs"


class TimingMode(Choice):
    """``--timing``: no kernel timing, timing within the overhead budget, or every region."""

    OFF = "off"
    BUDGET = "budget"
    ALL = "all"


class UnknownTenant(Choice):
    """``--tenants.unknown``: a request naming an unconfigured tenant is refused, or served as ``other``."""

    REJECT = "reject"
    OTHER = OTHER


class Dtype(Choice):
    """``--model.dtype``: ``auto`` is bfloat16 on CUDA, float32 on CPU; the others are torch's names."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


def _check_choice(value: object, choices: type[Choice], flag: str) -> None:
    """Settings built in code (not parsed) may hold any text: the same one line as a bad flag."""
    if value not in tuple(choices):
        raise ConfigError(f"{flag} {value!r} must be one of {choices.listing()}")


#: Most step events a request's spans carry before a summary event (``--tracing.max-step-events``).
TRACING_MAX_STEP_EVENTS = 100
_OTLP_TRACES_PATH = "/v1/traces"


def otlp_traces_url(base: str) -> str:
    """OTLP/HTTP base URL (``http://collector:4318``) → traces URL (``.../v1/traces``), kept if given."""
    base = base.strip()
    return base if base.rstrip("/").endswith(_OTLP_TRACES_PATH) else base.rstrip("/") + _OTLP_TRACES_PATH


def resolve_tracing(flag: str | None, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(OTLP/HTTP traces URL, or None when tracing is off; where it came from: the flag or an env variable).

    ``--tracing.endpoint`` (a base URL, like ``OTEL_EXPORTER_OTLP_ENDPOINT``) wins. Without it, the
    OpenTelemetry variables turn tracing on: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL), else
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended), unless ``OTEL_SDK_DISABLED=true`` or
    ``OTEL_TRACES_EXPORTER=none``. Spans go out as OTLP over HTTP (protobuf) only.
    """
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(name, "").strip()
        if protocol:
            if protocol != "http/protobuf":
                raise ConfigError(f"{name}={protocol!r}: gpuscope serve exports spans as OTLP over HTTP "
                                  "(http/protobuf) only")
            break
    if flag:
        return otlp_traces_url(flag), "--tracing.endpoint"
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None, "OTEL_SDK_DISABLED"
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None, "OTEL_TRACES_EXPORTER"
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if not (traces or base):
        return None, ""
    if exporter not in ("", "otlp"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER={exporter!r}: gpuscope serve exports spans over OTLP only "
                          "(otlp or none)")
    if traces:
        return traces, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    return otlp_traces_url(base), "OTEL_EXPORTER_OTLP_ENDPOINT"


@dataclass(frozen=True)
class TenantSpec:
    """One tenant: its GPU-time share (normalized so all shares sum to 1) and priority class."""

    name: str
    share: float
    priority: str = "normal"

    @property
    def rank(self) -> int:
        """0 for high, 1 for normal, 2 for low: a lower rank may preempt a higher one."""
        return PRIORITIES[self.priority]


def parse_tenant_entries(text: str) -> tuple[TenantSpec, ...]:
    """``NAME:SHARE[:PRIORITY],...`` → tenants as listed (shares not yet normalized: see
    :func:`complete_tenants`); ValueError naming the bad entry."""
    specs: list[TenantSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) not in (2, 3):
            raise ValueError(f"entry {item!r} is not NAME:SHARE[:PRIORITY]")
        name, share_text = fields[0].strip(), fields[1].strip()
        priority = fields[2].strip() if len(fields) == 3 else "normal"
        if not valid_tenant_name(name):
            raise ValueError(f"name {name!r} must be {NAME_RULE}")
        try:
            share = float(share_text)
        except ValueError:
            raise ValueError(f"share {share_text!r} of {name!r} is not a number") from None
        if not 0 < share <= 1:
            raise ValueError(f"share of {name!r} is {share_text}; it must be in (0, 1]")
        if priority not in PRIORITIES:
            raise ValueError(f"priority {priority!r} of {name!r} must be high, normal or low")
        if any(s.name == name for s in specs):
            raise ValueError(f"{name!r} is listed twice")
        specs.append(TenantSpec(name, share, priority))
    if not specs:
        raise ValueError("no tenant is listed")
    total = sum(s.share for s in specs)
    if total > 1 + 1e-9:
        raise ValueError(f"shares sum to {total:g}; they must sum to at most 1")
    return tuple(specs)


def complete_tenants(specs: tuple[TenantSpec, ...],
                     unknown: str = UnknownTenant.REJECT) -> tuple[TenantSpec, ...]:
    """Tenants with shares normalized to sum to 1 (idempotent).

    Shares are fractions that sum to at most 1. With ``unknown="other"`` and
    no ``other`` listed, ``other`` gets what is left (priority low); with less
    than 1 in total and no ``other``, shares keep their proportions.
    """
    _check_choice(unknown, UnknownTenant, "--tenants.unknown")
    total = sum(s.share for s in specs)
    if unknown == UnknownTenant.OTHER and all(s.name != OTHER for s in specs):
        rest = 1 - total
        if rest < 1e-6:
            raise ConfigError("--tenants.unknown=other but no share is left for 'other': "
                              "list it in --tenants")
        specs = (*specs, TenantSpec(OTHER, rest, "low"))
        total = 1.0
    return tuple(TenantSpec(s.name, s.share / total, s.priority) for s in specs)


def parse_tenants(text: str, unknown: str = UnknownTenant.REJECT) -> tuple[TenantSpec, ...]:
    """``NAME:SHARE[:PRIORITY],...`` → tenants with shares normalized to sum to 1 (ConfigError if bad)."""
    try:
        specs = parse_tenant_entries(text)
    except ValueError as exc:
        raise ConfigError(f"--tenants: {exc}") from None
    return complete_tenants(specs, unknown)


@dataclass(frozen=True)
class ModelSpec:
    """Model size and placement (``--model.*``).

    ``hf`` names a local Hugging Face model folder to serve instead of the toy model; its own config
    then sets the architecture (``layers``/``dim``/``heads``/``seed`` are unused) and ``context`` caps
    prompt + completion tokens per request.
    """

    layers: int = setting("--model.layers", 2, "transformer blocks")
    dim: int = setting("--model.dim", 128, "hidden size")
    heads: int = setting("--model.heads", 4, "attention heads (must divide --model.dim)")
    context: int = setting("--model.context", 512, "context length in tokens (toy model: bytes + BOS)")
    seed: int = setting("--model.seed", 0, "seed of the random weights")
    checkpoint: str | None = setting("--model.checkpoint", None,
                                     "local state_dict file to load (never downloaded)")
    device: str = setting("--model.device", "auto", "auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: Dtype = setting("--model.dtype", Dtype.AUTO,
                           "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16")
    hf: str | None = setting("--model.hf", None, "local Hugging Face causal-LM folder to serve instead of "
                                                 "the toy model (no downloads)")
    cuda_graphs: bool = setting("--model.cuda-graphs", False,
                                "replay decode steps from CUDA graphs captured per batch size, their "
                                "modules timed on sampled replays (toy model, CUDA only)")

    def validate(self) -> None:
        if self.cuda_graphs and self.hf is not None:
            raise ConfigError("--model.cuda-graphs replays the toy model's decode step; "
                              "it cannot go with --model.hf")
        if self.cuda_graphs and self.device == "cpu":
            raise ConfigError("--model.cuda-graphs needs a CUDA device (--model.device is cpu)")
        if self.hf is not None:
            where = f"--model.hf {self.hf!r}"
            if self.checkpoint:
                raise ConfigError("--model.checkpoint (a toy-model state dict) cannot go with --model.hf")
            if not os.path.isdir(self.hf):
                raise ConfigError(f"{where} is not a local folder (models are never downloaded)")
            if not os.path.isfile(os.path.join(self.hf, "config.json")):
                raise ConfigError(f"{where} has no config.json: not a Hugging Face model folder")
        for name in ("layers", "dim", "heads", "context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--model.{name} must be at least 1")
        if self.dim % self.heads:
            raise ConfigError(f"--model.dim {self.dim} is not a multiple of --model.heads {self.heads}")
        if self.context < 2:
            raise ConfigError("--model.context must be at least 2 tokens")
        _check_choice(self.dtype, Dtype, "--model.dtype")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``gpuscope serve`` needs; build it with ``validate()`` before use.

    Fields made with ``setting`` are its flags (``main.build_parser``); the others are derived:
    ``validate`` fills the tenant shares, default tenant and model name, ``main.resolve`` what the
    environment and files hold (tokens, the OpenTelemetry endpoint, this instance's name).
    """

    listen: tuple[str, int] = setting(
        "--web.listen-address", parse_listen_address(default_listen_address("server")),
        "HOST:PORT to listen on", parse=parse_listen_address, metavar="HOST:PORT")
    #: None until ``validate``: gpuscope-tiny, or --model.hf's folder name.
    model_name: str | None = setting("--model.name", None, "model id in /v1/models and responses "
                                                           "(gpuscope-tiny, or --model.hf's folder name)")
    model: ModelSpec = group(ModelSpec)
    #: As listed until ``validate``, which normalizes the shares and adds ``other`` if asked to.
    tenants: tuple[TenantSpec, ...] = setting("--tenants", parse_tenants("default:1:normal"),
                                              "NAME:SHARE[:PRIORITY],... GPU-time shares",
                                              parse=parse_tenant_entries, metavar="NAME:SHARE[:PRIORITY],...")
    #: None until ``validate``: the first tenant listed.
    default_tenant: str | None = setting("--tenants.default", None,
                                         "tenant of requests without X-Tenant (first listed)")
    unknown_tenant: UnknownTenant = setting("--tenants.unknown", UnknownTenant.REJECT,
                                            "unknown X-Tenant: reject (400) or other")
    scheduler: SchedulerMode = setting("--scheduler", SchedulerMode.SHARE,
                                       "share (GPU-time shares + priorities) or fcfs")
    batching: bool = setting("--batching", True, "dynamic batching (off: one request at a time)")
    max_batch_size: int = setting("--batch.max-size", 8, "requests per model step")
    max_wait_s: float = setting("--batch.max-wait", 0.005, "seconds a first batch waits to fill")
    max_queue_per_tenant: int = setting("--queue.max-per-tenant", 64,
                                        "waiting requests per tenant before 429")
    max_tokens_limit: int = setting("--request.max-tokens", 256, "largest max_tokens accepted")
    max_body_bytes: int = setting("--request.max-body-bytes", 65536, "largest request body accepted")
    timing: TimingMode = setting("--timing", TimingMode.BUDGET,
                                 "kernel timing: off, budget (default) or all regions")
    timing_budget: float = setting("--timing.budget", 0.01, "timer overhead budget (share of wall time)")
    timing_kernel_busy: bool = setting(
        "--timing.kernel-busy", False,
        "per-module kernel busy ratio from sampled CUPTI windows (GPU; needs gpuscope[cupti])")
    #: Names of the serving metrics on /metrics: gpuscope's catalogue, or vLLM's.
    metric_names: MetricNames = setting(
        "--metrics.names", MetricNames.GPUSCOPE,
        "serving metrics under gpuscope's names, or vllm: vLLM's names, labels (model_name, engine) and "
        "buckets, for the bundle's vLLM source (no kernel timing or tenant series)")
    faults_enabled: bool = setting("--faults.enable", False, "fault-injection admin API (needs a token)")
    faults_token_file: str | None = setting("--faults.token-file", None,
                                            "file holding the fault-injection bearer token")
    #: From --faults.token-file or GPUSCOPE_FAULTS_TOKEN, never a flag (it would show in ``ps``).
    faults_token: str | None = None
    loki_url: str | None = setting("--loki.url", None,
                                   "Loki base URL, e.g. http://loki:3100 (off when unset)")
    instance: str = ""
    #: The flag's base URL; ``main.resolve`` turns it (or the OTEL_* environment) into the OTLP/HTTP traces
    #: URL (``.../v1/traces``). None: no spans. ``tracing_source`` says what set it.
    tracing_endpoint: str | None = setting(
        "--tracing.endpoint", None, "OTLP/HTTP base URL for request spans, e.g. http://otel-collector:4318 "
        "(off when unset; OTEL_EXPORTER_OTLP_ENDPOINT also turns it on)")
    tracing_source: str = ""
    #: Head sampling ratio of root requests (parent-based); None: OTEL_TRACES_SAMPLER's, else always.
    tracing_sample_ratio: float | None = setting(
        "--tracing.sample-ratio", None,
        "share of root requests traced, parent-based (default: OTEL_TRACES_SAMPLER's, else 1)",
        parse=parse_float)
    tracing_max_step_events: int = setting(
        "--tracing.max-step-events", 8, "step events a request's spans carry at most (the first half, then "
        "the slowest), then a summary event; each costs ~30 µs of CPU to build and encode")
    log_level: LogLevel = setting("--log.level", LogLevel.INFO, "debug, info, warning (or warn) or error")
    #: On-demand profile captures; None (or not enabled): off.
    profile: ProfileConfig | None = group(ProfileConfig, default=None)
    #: Read deadlines, connection cap and shutdown grace of the HTTP side (``--web.*``, ``--shutdown.grace``).
    http: HttpLimits = group(HttpLimits)

    @property
    def host(self) -> str:
        return self.listen[0]

    @property
    def port(self) -> int:
        return self.listen[1]

    @property
    def batch_size(self) -> int:
        """Requests per step: 1 with batching off."""
        return self.max_batch_size if self.batching else 1

    def tenant(self, name: str) -> TenantSpec | None:
        return next((t for t in self.tenants if t.name == name), None)

    def validate(self) -> ServerConfig:
        """This config with its derived fields filled in, or ConfigError naming the first bad setting."""
        self.model.validate()
        profile = self.profile if self.profile is not None and self.profile.enable else None
        for part in (self.http, profile):
            try:
                if part is not None:
                    part.validate()
            except ValueError as exc:  # their own errors: the parts import nothing of the server's
                raise ConfigError(str(exc)) from None
        _check_choice(self.scheduler, SchedulerMode, "--scheduler")
        _check_choice(self.timing, TimingMode, "--timing")
        _check_choice(self.metric_names, MetricNames, "--metrics.names")
        _check_choice(self.log_level, LogLevel, "--log.level")
        tenants = complete_tenants(self.tenants, self.unknown_tenant)
        config = replace(self, tenants=tenants, default_tenant=self.default_tenant or tenants[0].name,
                         model_name=self.model_name or _default_model_name(self.model),
                         profile=profile)
        config._check()
        return config

    def _check(self) -> None:
        if not 0 < self.timing_budget < 1:
            raise ConfigError("--timing.budget must be in (0, 1)")
        if self.timing_kernel_busy and self.timing == TimingMode.OFF:
            raise ConfigError("--timing.kernel-busy needs the timer: drop --timing off")
        if not 1 <= self.max_batch_size <= 1024:
            raise ConfigError("--batch.max-size must be between 1 and 1024")
        if not 0 <= self.max_wait_s <= 10:
            raise ConfigError("--batch.max-wait must be between 0 and 10 seconds")
        if self.max_queue_per_tenant < 1:
            raise ConfigError("--queue.max-per-tenant must be at least 1")
        if not 1 <= self.max_tokens_limit < self.model.context:
            raise ConfigError(
                f"--request.max-tokens {self.max_tokens_limit} must be between 1 and "
                f"--model.context - 1 ({self.model.context - 1})")
        if self.max_body_bytes < 1024:
            raise ConfigError("--request.max-body-bytes must be at least 1024")
        if self.tenant(self.default_tenant) is None:
            names = ", ".join(t.name for t in self.tenants)
            raise ConfigError(f"--tenants.default {self.default_tenant!r} is not a configured tenant "
                              f"({names})")
        if self.faults_enabled and not self.faults_token:
            raise ConfigError("--faults.enable needs a token: --faults.token-file or GPUSCOPE_FAULTS_TOKEN")
        if self.faults_token is not None and len(self.faults_token) < 16:
            raise ConfigError("the fault-injection token must be at least 16 characters")
        if self.loki_url is not None and not re.match(r"^https?://[^\s/]+", self.loki_url):
            raise ConfigError(f"--loki.url {self.loki_url!r} is not an http(s) URL")
        if self.tracing_endpoint is not None and not re.match(r"^https?://[^\s/]+", self.tracing_endpoint):
            source = self.tracing_source or "--tracing.endpoint"
            raise ConfigError(f"{source} {self.tracing_endpoint!r} is not an http(s) URL")
        if self.tracing_sample_ratio is not None and not 0 <= self.tracing_sample_ratio <= 1:
            raise ConfigError("--tracing.sample-ratio must be between 0 and 1")
        if not 0 <= self.tracing_max_step_events <= TRACING_MAX_STEP_EVENTS:
            raise ConfigError(f"--tracing.max-step-events must be between 0 and {TRACING_MAX_STEP_EVENTS}")


def _default_model_name(model: ModelSpec) -> str:
    if model.hf is not None:
        return os.path.basename(os.path.normpath(model.hf)) or "hf-model"
    return "gpuscope-tiny"
