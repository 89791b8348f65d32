"""Settings of on-demand profile captures (``gpuscope serve --profile.*``), validated in one place.

The flags live here, not in the server's ``main.py`` and its long list, so the feature's settings
read in one page. Like the fault-injection API, captures are off unless ``--profile.enable`` is given
with a token, and the token comes only from a file or ``GPUSCOPE_PROFILE_TOKEN``, never the command
line.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from gpuscope.util.settings import setting

TOKEN_ENV = "GPUSCOPE_PROFILE_TOKEN"
MIN_TOKEN_LENGTH = 16
MODES = ("auto", "kernels", "regions")


class ProfileSettingsError(ValueError):
    """A profile setting out of range; the message is the one line ``gpuscope serve`` prints."""


@dataclass(frozen=True)
class ProfileConfig:
    """Where traces go and the limits on them (docs/server.md, *Kernel profiles*)."""

    enable: bool = setting("--profile.enable", False, "POST /admin/profile captures kernel profiles of the "
                           f"next steps (needs a token: --profile.token-file or {TOKEN_ENV})")
    token_file: str | None = setting("--profile.token-file", None,
                                     "file holding the profile endpoint's bearer token")
    directory: str = setting("--profile.dir", os.path.join(tempfile.gettempdir(), "gpuscope-profiles"),
                             "where trace files are written")
    #: at most one accepted capture per this many seconds (429 with Retry-After in between)
    min_interval_s: float = setting("--profile.min-interval", 300.0,
                                    "seconds between accepted captures (429 before)")
    default_steps: int = setting("--profile.steps", 16, "steps captured when not asked")
    max_steps: int = setting("--profile.max-steps", 256, "most steps one capture may ask for")
    #: a capture that has not seen its steps by then is written with what it has (outcome partial)
    window_timeout_s: float = setting("--profile.window-timeout", 60.0,
                                      "seconds a capture waits for its steps before writing what it has")
    #: trace events per file and bytes per file; beyond them events are left out (counted)
    max_events: int = setting("--profile.max-events", 200_000, "trace events per file at most")
    max_bytes: int = setting("--profile.max-bytes", 16 << 20, "bytes per trace file at most")
    #: trace files kept; the oldest beyond it are deleted, so the directory holds keep × max_bytes at most
    keep: int = setting("--profile.keep", 20, "trace files kept (oldest deleted first)")
    #: From --profile.token-file or GPUSCOPE_PROFILE_TOKEN (``main.resolve``), never a flag.
    token: str = ""

    def validate(self) -> ProfileConfig:
        if len(self.token) < MIN_TOKEN_LENGTH:
            raise ProfileSettingsError(f"the profile token must be at least {MIN_TOKEN_LENGTH} characters")
        checks = (
            (self.min_interval_s >= 0, "--profile.min-interval must be >= 0"),
            (1 <= self.default_steps <= self.max_steps,
             "--profile.steps must be between 1 and --profile.max-steps"),
            (self.window_timeout_s > 0, "--profile.window-timeout must be > 0"),
            (self.max_events >= 100, "--profile.max-events must be at least 100"),
            (self.max_bytes >= 64 << 10, "--profile.max-bytes must be at least 65536"),
            (self.keep >= 1, "--profile.keep must be at least 1"),
        )
        for ok, message in checks:
            if not ok:
                raise ProfileSettingsError(message)
        return self
