"""Go-exporter-style command-line flags shared by every gpuscope command.

Every flag is also an environment variable: ``--web.listen-address`` reads
``GPUSCOPE_WEB_LISTEN_ADDRESS`` when the flag is not given. A bad flag or value
prints one readable line and exits with status 2 (argparse's usage dump is not
what an operator reading a crash-looping container wants).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")


def env_name(flag: str) -> str:
    """``--collector.pcie`` → ``GPUSCOPE_COLLECTOR_PCIE``."""
    return "GPUSCOPE_" + flag.lstrip("-").replace(".", "_").replace("-", "_").upper()


class FlagValueError(argparse.ArgumentTypeError, ValueError):
    """A bad flag value: argparse shows its message as is (it hides plain ValueErrors' messages), and
    the environment-variable path catches it as a ValueError."""


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse ``type``: its ValueError messages reach the user's one error line."""

    def flag_type(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise FlagValueError(str(exc)) from None

    flag_type.__name__ = getattr(parse, "__name__", "value")
    return flag_type


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?\s*$")


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """``"1s"``, ``"500ms"``, ``"2m"`` or bare seconds (``"1.5"``) → seconds (> 0 unless allow_zero)."""
    match = _DURATION.match(text.lower())
    if not match:
        raise ValueError(f"{text!r} is not a duration such as 1s, 500ms or 2m")
    value = float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{text!r} must be greater than zero")
    return value


def parse_listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) → (host, port); raises ValueError with the reason."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {value!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def listen_address(value: str) -> str:
    """``HOST:PORT`` checked (as :func:`parse_listen_address`) and kept as text, for messages."""
    parse_listen_address(value)
    return value


class FlagParser(argparse.ArgumentParser):
    """ArgumentParser whose flags fall back to environment variables and whose errors are one line."""

    def add_flag(self, flag: str, **kwargs) -> argparse.Action:
        """Add ``--flag`` with its environment variable named in the help and used as default."""
        env = env_name(flag)
        kwargs["help"] = f"{kwargs.get('help', '')} [env {env}]".strip()
        action = self.add_argument(flag, **kwargs)
        raw = os.environ.get(env)
        if raw is not None:
            action.default = self._env_value(action, env, raw)
        return action

    def _env_value(self, action: argparse.Action, env: str, raw: str):
        if isinstance(action, argparse.BooleanOptionalAction):
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            self.error(f"{env}={raw!r} is not a boolean (true/false)")
        if action.type is not None:
            try:
                return action.type(raw)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                self.error(f"{env}={raw!r}: {exc}")
        return raw

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)
