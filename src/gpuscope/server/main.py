"""``gpuscope serve``: flags → validated config → service → aiohttp app.

Every flag is also an environment variable (``--batch.max-size`` ↔
``GPUSCOPE_BATCH_MAX_SIZE``); the fault-injection token comes only from a file
or ``GPUSCOPE_FAULTS_TOKEN``, never the command line (it would show in ``ps``).
A bad flag or config prints one line and exits 2.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import socket
import sys
from functools import partial

from prometheus_client import CollectorRegistry

from gpuscope.contract import parts
from gpuscope.contract.parts import default_listen_address
from gpuscope.logs.loki_push import LokiHandler
from gpuscope.util.flags import FlagParser, checked, parse_duration, parse_listen_address
from gpuscope.util.logsafe import EscapingFilter

from . import profile_config
from .api import build_app, run
from .config import ConfigError, ModelSpec, ServerConfig, parse_tenants, resolve_tracing
from .http_settings import HttpLimits
from .service import Service

PROG = "gpuscope serve"


def build_parser() -> FlagParser:
    p = FlagParser(prog=PROG, description="Reference inference server, instrumented with gpuscope.")
    p.add_flag("--web.listen-address", default=default_listen_address("server"),
               help="HOST:PORT to listen on")
    p.add_flag("--model.name", default=None,
               help="model id in /v1/models and responses (gpuscope-tiny, or --model.hf's folder name)")
    p.add_flag("--model.layers", type=int, default=2, help="transformer blocks")
    p.add_flag("--model.dim", type=int, default=128, help="hidden size")
    p.add_flag("--model.heads", type=int, default=4, help="attention heads (must divide --model.dim)")
    p.add_flag("--model.context", type=int, default=512,
               help="context length in tokens (toy model: bytes + BOS)")
    p.add_flag("--model.seed", type=int, default=0, help="seed of the random weights")
    p.add_flag("--model.checkpoint", default=None, help="local state_dict file to load (never downloaded)")
    p.add_flag("--model.hf", default=None,
               help="local Hugging Face causal-LM folder to serve instead of the toy model (no downloads)")
    p.add_flag("--model.device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    p.add_flag("--model.dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, ...")
    p.add_toggle("model.cuda-graphs", False, "replay decode steps from CUDA graphs captured per batch size, "
                 "their modules timed on sampled replays (toy model, CUDA only)")
    p.add_flag("--tenants", default="default:1:normal", help="NAME:SHARE[:PRIORITY],... GPU-time shares")
    p.add_flag("--tenants.default", default=None, help="tenant of requests without X-Tenant (first listed)")
    p.add_flag("--tenants.unknown", default="reject", help="unknown X-Tenant: reject (400) or other")
    p.add_flag("--scheduler", default="share", help="share (GPU-time shares + priorities) or fcfs")
    p.add_toggle("batching", True, "dynamic batching (off: one request at a time)")
    p.add_flag("--batch.max-size", type=int, default=8, help="requests per model step")
    p.add_flag("--batch.max-wait", type=float, default=0.005, help="seconds a first batch waits to fill")
    p.add_flag("--queue.max-per-tenant", type=int, default=64, help="waiting requests per tenant before 429")
    p.add_flag("--request.max-tokens", type=int, default=256, help="largest max_tokens accepted")
    p.add_flag("--request.max-body-bytes", type=int, default=65536, help="largest request body accepted")
    p.add_flag("--timing", default="budget", help="kernel timing: off, budget (default) or all regions")
    p.add_flag("--timing.budget", type=float, default=0.01, help="timer overhead budget (share of wall time)")
    p.add_toggle("timing.kernel-busy", False,
                 "per-module kernel busy ratio from sampled CUPTI windows (GPU; needs gpuscope[cupti])")
    p.add_flag("--metrics.names", default="gpuscope",
               help="serving metrics under gpuscope's names, or vllm: vLLM's names, labels (model_name, "
                    "engine) and buckets, for the bundle's vLLM source (no kernel timing or tenant series)")
    p.add_toggle("faults.enable", False, "fault-injection admin API (needs a token)")
    p.add_flag("--faults.token-file", default=None, help="file holding the fault-injection bearer token")
    p.add_flag("--loki.url", default=None, help="Loki base URL, e.g. http://loki:3100 (off when unset)")
    p.add_flag("--tracing.endpoint", default=None,
               help="OTLP/HTTP base URL for request spans, e.g. http://otel-collector:4318 (off when unset; "
                    "OTEL_EXPORTER_OTLP_ENDPOINT also turns it on)")
    p.add_flag("--tracing.sample-ratio", type=float, default=None,
               help="share of root requests traced, parent-based (default: OTEL_TRACES_SAMPLER's, else 1)")
    p.add_flag("--tracing.max-step-events", type=int, default=8,
               help="step events a request's spans carry at most (the first half, then the slowest), "
                    "then a summary event; each costs ~30 µs of CPU to build and encode")
    p.add_flag("--log.level", default="info", help="debug, info, warning or error")
    profile_config.add_flags(p)
    p.add_flag("--web.header-timeout", type=checked(parse_duration), default="10s",
               help="a request's line and headers must arrive within this (else 408, connection closed)")
    p.add_flag("--web.body-timeout", type=checked(parse_duration), default="30s",
               help="a request's body must arrive within this once its headers are in (else 408)")
    p.add_flag("--web.max-connections", type=int, default=512,
               help="open connections at most: a new one closes an idle or stalled one, else gets 503")
    p.add_flag("--shutdown.grace", type=checked(partial(parse_duration, allow_zero=True)), default="10s",
               help="on SIGTERM/SIGINT: how long running requests may finish (new ones get 503); then "
                    "streams end with an error chunk and [DONE] (keep the orchestrator's grace above it)")
    return p


def config_from_args(ns) -> ServerConfig:
    """Namespace → validated ServerConfig, or ConfigError with one line."""
    args = vars(ns)
    try:
        host, port = parse_listen_address(args["web.listen_address"])
    except ValueError as exc:
        raise ConfigError(f"--web.listen-address: {exc}") from None
    unknown = args["tenants.unknown"]
    tenants = parse_tenants(args["tenants"], unknown)
    token = os.environ.get("GPUSCOPE_FAULTS_TOKEN")
    if args["faults.token_file"]:
        try:
            with open(args["faults.token_file"]) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--faults.token-file: cannot read {args['faults.token_file']}: "
                              f"{exc.strerror}") from None
    model = ModelSpec(layers=args["model.layers"], dim=args["model.dim"], heads=args["model.heads"],
                      context=args["model.context"], seed=args["model.seed"],
                      checkpoint=args["model.checkpoint"], device=args["model.device"],
                      dtype=args["model.dtype"], hf=args["model.hf"],
                      cuda_graphs=args["model.cuda_graphs"])
    if model.checkpoint and not os.path.isfile(model.checkpoint):
        raise ConfigError(f"--model.checkpoint {model.checkpoint!r} is not a local file")
    tracing_endpoint, tracing_source = resolve_tracing(args["tracing.endpoint"], os.environ)
    return ServerConfig(
        host=host, port=port, model=model, model_name=args["model.name"] or _default_model_name(model),
        tenants=tenants,
        default_tenant=args["tenants.default"] or tenants[0].name, unknown_tenant=unknown,
        scheduler=args["scheduler"], batching=args["batching"], max_batch_size=args["batch.max_size"],
        max_wait_s=args["batch.max_wait"], max_queue_per_tenant=args["queue.max_per_tenant"],
        max_tokens_limit=args["request.max_tokens"], max_body_bytes=args["request.max_body_bytes"],
        timing=args["timing"], timing_budget=args["timing.budget"],
        timing_kernel_busy=args["timing.kernel_busy"], metric_names=args["metrics.names"],
        faults_enabled=args["faults.enable"],
        faults_token=token if args["faults.enable"] else None, loki_url=args["loki.url"],
        instance=f"{socket.gethostname()}:{port}",
        tracing_endpoint=tracing_endpoint, tracing_source=tracing_source,
        tracing_sample_ratio=args["tracing.sample_ratio"],
        tracing_max_step_events=args["tracing.max_step_events"],
        profile=profile_config.from_args(args, os.environ),
        http=HttpLimits(header_timeout_s=args["web.header_timeout"], body_timeout_s=args["web.body_timeout"],
                        max_connections=args["web.max_connections"], shutdown_grace_s=args["shutdown.grace"]),
    ).validate()


def _default_model_name(model: ModelSpec) -> str:
    if model.hf is not None:
        return os.path.basename(os.path.normpath(model.hf)) or "hf-model"
    return "gpuscope-tiny"


def setup_logging(config: ServerConfig, level: str, registry: CollectorRegistry) -> list[logging.Handler]:
    """stderr through a queue (a slow terminal or pipe never stalls the engine), plus Loki when set."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"--log.level {level!r} must be debug, info, warning or error")
    root = logging.getLogger("gpuscope")
    root.setLevel(numeric)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    stderr.addFilter(EscapingFilter())  # one record, one line: client text in a message cannot forge lines
    records: queue.SimpleQueue = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(records, stderr)
    listener.start()
    root.addHandler(logging.handlers.QueueHandler(records))
    # OpenTelemetry's own warnings (they may quote a client's headers): through the same handler, with
    # time and level, instead of Python's last-resort print of the bare message.
    otel = logging.getLogger("opentelemetry")
    otel.addHandler(logging.handlers.QueueHandler(records))
    otel.propagate = False
    handlers: list[logging.Handler] = []
    if config.loki_url:
        # The server's own registry: that is what its /metrics serves.
        loki = LokiHandler(config.loki_url, service=parts.SERVER.service, instance=config.instance,
                           registry=registry)
        root.addHandler(loki)
        handlers.append(loki)
    handlers.append(_ListenerStopper(listener))
    return handlers


class _ListenerStopper(logging.Handler):
    """Lets shutdown stop the stderr queue listener like any other handler (``close``)."""

    def __init__(self, listener: logging.handlers.QueueListener) -> None:
        super().__init__()
        self._listener: logging.handlers.QueueListener | None = listener

    def emit(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        # Runs twice: main's finally, then logging's atexit shutdown (which closes every handler ever
        # made). QueueListener.stop() is not idempotent, so only the first close stops it.
        with self.lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()
        super().close()


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    registry = CollectorRegistry()
    try:
        config = config_from_args(ns)
        handlers = setup_logging(config, ns.__dict__["log.level"], registry)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    log = logging.getLogger("gpuscope.server")
    tracing_class = None
    if config.tracing_endpoint is not None:
        try:
            from .tracing import RequestTracing as tracing_class
        except ImportError as exc:
            message = (f"{config.tracing_source} asks for request spans, but OpenTelemetry is not installed "
                       f"({exc.name or exc}): pip install 'gpuscope[tracing]'")
            if config.tracing_source == "--tracing.endpoint":
                sys.stderr.write(f"{PROG}: error: {message}\n")
                for handler in handlers:
                    handler.close()
                return 2
            # Set in the environment (platforms inject OTEL_* everywhere): serve, without spans.
            log.warning("%s; serving without spans", message)
    try:
        service = Service(config, registry)
    except ConfigError as exc:  # --model.hf: the folder is not a loadable model
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    except (OSError, RuntimeError, ValueError) as exc:
        sys.stderr.write(f"{PROG}: error: cannot build the model: {exc}\n".replace("\n", " ").rstrip() + "\n")
        return 1
    tracing = None
    if tracing_class is not None:
        tracing = tracing_class(config, registry)
        log.info("tracing: spans over OTLP/HTTP to %s (from %s)", config.tracing_endpoint,
                 config.tracing_source)
    log.info("listening on http://%s:%d (model %s on %s, scheduler %s, timing %s)", config.host, config.port,
             config.model_name, service.device, config.scheduler, config.timing)
    try:
        run(build_app(service, tracing=tracing), config.host, config.port)
    except OSError as exc:
        sys.stderr.write(f"{PROG}: error: cannot listen on {config.host}:{config.port}: {exc.strerror}\n")
        service.close()
        return 1
    finally:
        for handler in handlers:
            handler.close()
    return 0
