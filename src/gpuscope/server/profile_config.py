"""Settings of on-demand profile captures (``gpuscope serve --profile.*``), validated in one place.

The flags live here, not in ``main.py``'s long list, so the feature's settings read in one page.
Like the fault-injection API, captures are off unless ``--profile.enable`` is given with a token,
and the token comes only from a file or ``GPUSCOPE_PROFILE_TOKEN``, never the command line.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuscope.util.flags import FlagParser

from .config import ConfigError

TOKEN_ENV = "GPUSCOPE_PROFILE_TOKEN"
MIN_TOKEN_LENGTH = 16
MODES = ("auto", "kernels", "regions")


@dataclass(frozen=True)
class ProfileConfig:
    """Where traces go and the limits on them (docs/server.md, *Kernel profiles*)."""

    token: str
    directory: str = os.path.join(tempfile.gettempdir(), "gpuscope-profiles")
    #: at most one accepted capture per this many seconds (429 with Retry-After in between)
    min_interval_s: float = 300.0
    default_steps: int = 16
    max_steps: int = 256
    #: a capture that has not seen its steps by then is written with what it has (outcome partial)
    window_timeout_s: float = 60.0
    #: trace events per file and bytes per file; beyond them events are left out (counted)
    max_events: int = 200_000
    max_bytes: int = 16 << 20
    #: trace files kept; the oldest beyond it are deleted, so the directory holds keep × max_bytes at most
    keep: int = 20

    def validate(self) -> ProfileConfig:
        if len(self.token) < MIN_TOKEN_LENGTH:
            raise ConfigError(f"the profile token must be at least {MIN_TOKEN_LENGTH} characters")
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
                raise ConfigError(message)
        return self


def add_flags(p: FlagParser) -> None:
    """The ``--profile.*`` flags of ``gpuscope serve``."""
    d = ProfileConfig(token="")
    p.add_toggle("profile.enable", False, "POST /admin/profile captures kernel profiles of the next steps "
                 "(needs a token: --profile.token-file or GPUSCOPE_PROFILE_TOKEN)")
    p.add_flag("--profile.token-file", default=None, help="file holding the profile endpoint's bearer token")
    p.add_flag("--profile.dir", default=d.directory, help="where trace files are written")
    p.add_flag("--profile.min-interval", type=float, default=d.min_interval_s,
               help="seconds between accepted captures (429 before)")
    p.add_flag("--profile.steps", type=int, default=d.default_steps, help="steps captured when not asked")
    p.add_flag("--profile.max-steps", type=int, default=d.max_steps,
               help="most steps one capture may ask for")
    p.add_flag("--profile.window-timeout", type=float, default=d.window_timeout_s,
               help="seconds a capture waits for its steps before writing what it has")
    p.add_flag("--profile.max-events", type=int, default=d.max_events, help="trace events per file at most")
    p.add_flag("--profile.max-bytes", type=int, default=d.max_bytes, help="bytes per trace file at most")
    p.add_flag("--profile.keep", type=int, default=d.keep, help="trace files kept (oldest deleted first)")


def from_args(args: Mapping[str, Any], environ: Mapping[str, str]) -> ProfileConfig | None:
    """The parsed flags (``vars(namespace)``) → a validated ProfileConfig, None when off, or ConfigError."""
    if not args["profile.enable"]:
        return None
    token = environ.get(TOKEN_ENV)
    path = args["profile.token_file"]
    if path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--profile.token-file: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"--profile.enable needs a token: --profile.token-file or {TOKEN_ENV}")
    return ProfileConfig(
        token=token, directory=args["profile.dir"], min_interval_s=args["profile.min_interval"],
        default_steps=args["profile.steps"], max_steps=args["profile.max_steps"],
        window_timeout_s=args["profile.window_timeout"], max_events=args["profile.max_events"],
        max_bytes=args["profile.max_bytes"], keep=args["profile.keep"]).validate()
