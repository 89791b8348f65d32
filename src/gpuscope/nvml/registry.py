"""Every collector registers itself where it is defined (node_exporter's ``registerCollector``).

A registration is the one place that names a collector, says whether it is on by default and what
its ``--collector.NAME`` flag's help says, and points at the class that builds it. The flags
(``config.py``) and the exporter's assembly (``exporter.py``) both read this table (through
``collector_table``, which imports the modules that define collectors), so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class Registration:
    name: str
    default: bool  # on unless --no-collector.NAME
    help: str
    cls: type


_REGISTERED: dict[str, Registration] = {}


def register_collector(name: str, *, default: bool, help: str) -> Callable[[T], T]:
    """Class decorator: register ``cls`` as the collector ``name`` (and set ``cls.name``)."""

    def register(cls: T) -> T:
        if name in _REGISTERED:
            raise ValueError(f"collector {name!r} registered twice")
        cls.name = name
        _REGISTERED[name] = Registration(name, default, help, cls)
        return cls

    return register


def registrations() -> dict[str, Registration]:
    """The collectors registered so far, in registration order (``collector_table.registered()`` has
    them all: it imports every module that defines one)."""
    return dict(_REGISTERED)
