"""Settings of the server's HTTP side: read deadlines, connection cap, shutdown grace (``--web.*``,
``--shutdown.grace``). Plain data, no aiohttp: ``limits.py`` and ``shutdown.py`` act on them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from gpuscope.util.flags import parse_duration
from gpuscope.util.settings import setting


class HttpSettingsError(ValueError):
    """A setting out of range; the message is the one line ``gpuscope serve`` prints."""


@dataclass(frozen=True)
class HttpLimits:
    """Deadlines and caps of the server's HTTP side (``--web.*`` flags) and its shutdown grace."""

    header_timeout_s: float = setting(
        "--web.header-timeout", 10.0, "a request's line and headers must arrive within this (else 408, "
        "connection closed)", parse=parse_duration)
    body_timeout_s: float = setting(
        "--web.body-timeout", 30.0, "a request's body must arrive within this once its headers are in "
        "(else 408)", parse=parse_duration)
    max_connections: int = setting("--web.max-connections", 512, "open connections at most: a new one closes "
                                   "an idle or stalled one, else gets 503")
    #: On SIGTERM/SIGINT: how long requests in flight may run on before they are ended (shutdown.py).
    shutdown_grace_s: float = setting(
        "--shutdown.grace", 10.0, "on SIGTERM/SIGINT: how long running requests may finish (new ones get "
        "503); then streams end with an error chunk and [DONE] (keep the orchestrator's grace above it)",
        parse=partial(parse_duration, allow_zero=True))

    def validate(self) -> HttpLimits:
        if not 0 < self.header_timeout_s <= 3600:
            raise HttpSettingsError("--web.header-timeout must be between 0 and 1h")
        if not 0 < self.body_timeout_s <= 3600:
            raise HttpSettingsError("--web.body-timeout must be between 0 and 1h")
        if not 1 <= self.max_connections <= 1_000_000:
            raise HttpSettingsError("--web.max-connections must be at least 1")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise HttpSettingsError("--shutdown.grace must be between 0 and 1h")
        return self
