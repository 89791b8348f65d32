"""Server configuration, validated in one place.

``ServerConfig`` holds every setting of ``gpuscope serve``; ``parse_tenants``
turns ``--tenants "alpha:0.7:high,beta:0.3:low"`` into ``TenantSpec`` objects.
Every check raises ``ConfigError`` with one readable line, which ``main``
prints before exiting with status 2.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuscope.contract.tenants import NAME_RULE, valid_tenant_name

from .http_settings import HttpLimits, HttpSettingsError

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
#: ``--metrics.names``: gpuscope's own names, or vLLM's (names, labels, buckets of vLLM's V1 engine).
METRIC_NAMES = ("gpuscope", "vllm")
OTHER = "other"


class ConfigError(ValueError):
    """A setting that cannot work; the message is one line naming the setting."""


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


def parse_tenants(text: str, unknown: str = "reject") -> tuple[TenantSpec, ...]:
    """``NAME:SHARE[:PRIORITY],...`` → tenants with shares normalized to sum to 1.

    Shares are fractions that must sum to at most 1. With ``unknown="other"`` and
    no ``other`` listed, ``other`` gets what is left (priority low); with less
    than 1 in total and no ``other``, shares keep their proportions.
    """
    if unknown not in ("reject", OTHER):
        raise ConfigError(f"--tenants.unknown={unknown!r} must be 'reject' or 'other'")
    specs: list[TenantSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        fields = item.split(":")
        if len(fields) not in (2, 3):
            raise ConfigError(f"--tenants entry {item!r} is not NAME:SHARE[:PRIORITY]")
        name, share_text = fields[0].strip(), fields[1].strip()
        priority = fields[2].strip() if len(fields) == 3 else "normal"
        if not valid_tenant_name(name):
            raise ConfigError(f"--tenants name {name!r} must be {NAME_RULE}")
        try:
            share = float(share_text)
        except ValueError:
            raise ConfigError(f"--tenants share {share_text!r} of {name!r} is not a number") from None
        if not 0 < share <= 1:
            raise ConfigError(f"--tenants share of {name!r} is {share_text}; it must be in (0, 1]")
        if priority not in PRIORITIES:
            raise ConfigError(f"--tenants priority {priority!r} of {name!r} must be high, normal or low")
        if any(s.name == name for s in specs):
            raise ConfigError(f"--tenants lists {name!r} twice")
        specs.append(TenantSpec(name, share, priority))
    if not specs:
        raise ConfigError("--tenants lists no tenant")
    total = sum(s.share for s in specs)
    if total > 1 + 1e-9:
        raise ConfigError(f"--tenants shares sum to {total:g}; they must sum to at most 1")
    if unknown == OTHER and all(s.name != OTHER for s in specs):
        rest = 1 - total
        if rest < 1e-6:
            raise ConfigError("--tenants.unknown=other but no share is left for 'other': "
                              "list it in --tenants")
        specs.append(TenantSpec(OTHER, rest, "low"))
        total = 1.0
    return tuple(TenantSpec(s.name, s.share / total, s.priority) for s in specs)


@dataclass(frozen=True)
class ModelSpec:
    """Model size and placement (``--model.*``).

    ``hf`` names a local Hugging Face model folder to serve instead of the toy model; its own config
    then sets the architecture (``layers``/``dim``/``heads``/``seed`` are unused) and ``context`` caps
    prompt + completion tokens per request.
    """

    layers: int = 2
    dim: int = 128
    heads: int = 4
    context: int = 512
    seed: int = 0
    checkpoint: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    hf: str | None = None
    cuda_graphs: bool = False  # replay decode steps from CUDA graphs captured per batch size

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
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--model.dtype {self.dtype!r} must be auto, float32, bfloat16 or float16")


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``gpuscope serve`` needs; build it with ``validate()`` before use."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: ModelSpec = field(default_factory=ModelSpec)
    model_name: str = "gpuscope-tiny"
    tenants: tuple[TenantSpec, ...] = (TenantSpec("default", 1.0, "normal"),)
    default_tenant: str = "default"
    unknown_tenant: str = "reject"
    scheduler: str = "share"
    batching: bool = True
    max_batch_size: int = 8
    max_wait_s: float = 0.005
    max_queue_per_tenant: int = 64
    max_tokens_limit: int = 256
    max_body_bytes: int = 65536
    timing: str = "budget"
    timing_budget: float = 0.01
    timing_kernel_busy: bool = False
    #: Names of the serving metrics on /metrics: gpuscope's catalogue, or vLLM's (``metrics.METRIC_NAMES``).
    metric_names: str = "gpuscope"
    faults_enabled: bool = False
    faults_token: str | None = None
    loki_url: str | None = None
    instance: str = ""
    #: OTLP/HTTP traces URL (``.../v1/traces``); None: no spans. ``tracing_source`` says what set it.
    tracing_endpoint: str | None = None
    tracing_source: str = ""
    #: Head sampling ratio of root requests (parent-based); None: OTEL_TRACES_SAMPLER's, else always.
    tracing_sample_ratio: float | None = None
    tracing_max_step_events: int = 8
    #: On-demand profile captures (``profile_config.ProfileConfig``); None: off.
    profile: Any = None
    #: Read deadlines, connection cap and shutdown grace of the HTTP side (``limits.HttpLimits``).
    http: HttpLimits = field(default_factory=HttpLimits)

    @property
    def batch_size(self) -> int:
        """Requests per step: 1 with batching off."""
        return self.max_batch_size if self.batching else 1

    def tenant(self, name: str) -> TenantSpec | None:
        return next((t for t in self.tenants if t.name == name), None)

    def validate(self) -> ServerConfig:
        self.model.validate()
        try:
            self.http.validate()
        except HttpSettingsError as exc:
            raise ConfigError(str(exc)) from None
        if self.scheduler not in ("share", "fcfs"):
            raise ConfigError(f"--scheduler {self.scheduler!r} must be 'share' or 'fcfs'")
        if self.timing not in ("off", "budget", "all"):
            raise ConfigError(f"--timing {self.timing!r} must be off, budget or all")
        if not 0 < self.timing_budget < 1:
            raise ConfigError("--timing.budget must be in (0, 1)")
        if self.timing_kernel_busy and self.timing == "off":
            raise ConfigError("--timing.kernel-busy needs the timer: drop --timing off")
        if self.metric_names not in METRIC_NAMES:
            raise ConfigError(f"--metrics.names {self.metric_names!r} must be one of "
                              f"{', '.join(METRIC_NAMES)}")
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
        if self.unknown_tenant not in ("reject", OTHER):
            raise ConfigError(f"--tenants.unknown={self.unknown_tenant!r} must be 'reject' or 'other'")
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
        return self
