"""Settings of the server's HTTP side: read deadlines, connection cap, shutdown grace (``--web.*``,
``--shutdown.grace``). Plain data, no aiohttp: ``limits.py`` and ``shutdown.py`` act on them."""

from __future__ import annotations

from dataclasses import dataclass


class HttpSettingsError(ValueError):
    """A setting out of range; the message is the one line ``gpuscope serve`` prints."""


@dataclass(frozen=True)
class HttpLimits:
    """Deadlines and caps of the server's HTTP side (``--web.*`` flags) and its shutdown grace."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 512
    #: On SIGTERM/SIGINT: how long requests in flight may run on before they are ended (shutdown.py).
    shutdown_grace_s: float = 10.0

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
