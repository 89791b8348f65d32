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
from collections.abc import Mapping, Sequence
from dataclasses import replace

from prometheus_client import CollectorRegistry

from gpuscope.contract import parts
from gpuscope.logs.loki_push import LokiHandler
from gpuscope.util.logsafe import EscapingFilter
from gpuscope.util.settings import LogLevel, SettingsParser, parser_for

from .api import build_app, run
from .config import ConfigError, ServerConfig, resolve_tracing
from .profile.config import TOKEN_ENV as PROFILE_TOKEN_ENV
from .service import Service

PROG = "gpuscope serve"
FAULTS_TOKEN_ENV = "GPUSCOPE_FAULTS_TOKEN"


def build_parser() -> SettingsParser[ServerConfig]:
    return parser_for(ServerConfig, prog=PROG,
                      description="Reference inference server, instrumented with gpuscope.")


def load_config(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> ServerConfig:
    """Flags and environment → validated ServerConfig; ConfigError with one line (a bad flag value:
    the parser's one line and SystemExit 2)."""
    return resolve(build_parser().parse_settings(argv), environ)


def resolve(config: ServerConfig, environ: Mapping[str, str]) -> ServerConfig:
    """The parsed flags plus what they point at: token files or variables, the OpenTelemetry
    endpoint, this instance's name; validated."""
    if config.model.checkpoint and not os.path.isfile(config.model.checkpoint):
        raise ConfigError(f"--model.checkpoint {config.model.checkpoint!r} is not a local file")
    tracing_endpoint, tracing_source = resolve_tracing(config.tracing_endpoint, environ)
    profile = config.profile
    if profile is not None and profile.enable:
        token = _read_token(profile.token_file, "--profile.token-file", environ.get(PROFILE_TOKEN_ENV))
        if not token:
            raise ConfigError(f"--profile.enable needs a token: --profile.token-file or {PROFILE_TOKEN_ENV}")
        profile = replace(profile, token=token)
    faults_token = _read_token(config.faults_token_file, "--faults.token-file", environ.get(FAULTS_TOKEN_ENV))
    return replace(config, faults_token=faults_token if config.faults_enabled else None,
                   instance=f"{socket.gethostname()}:{config.port}", tracing_endpoint=tracing_endpoint,
                   tracing_source=tracing_source, profile=profile).validate()


def _read_token(path: str | None, flag: str, fallback: str | None) -> str | None:
    """The token in ``path`` (stripped) when given, else ``fallback`` (its environment variable)."""
    if not path:
        return fallback
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def setup_logging(config: ServerConfig, level: str, registry: CollectorRegistry) -> list[logging.Handler]:
    """stderr through a queue (a slow terminal or pipe never stalls the engine), plus Loki when set."""
    try:
        numeric = LogLevel.parse(level).number
    except ValueError as exc:
        raise ConfigError(f"--log.level: {exc}") from None
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
    settings = build_parser().parse_settings(argv)
    registry = CollectorRegistry()
    try:
        config = resolve(settings, os.environ)
        handlers = setup_logging(config, config.log_level, registry)
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
