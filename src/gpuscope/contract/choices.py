"""The closed sets of names that several parts spell: each a :class:`Choice`, an enum of strings.

- ``MetricNames``: the metric-name sets ``gpuscope serve --metrics.names`` exposes (the server, the
  vLLM source's rules and the stack's vLLM mode name them);
- ``AlertProfile``: the alert profiles by name (``profiles.PROFILES``), as ``--stack.profile`` takes them;
- ``ServerSource``: the server's source as the stack and the drill run it: the scrape job it is read
  under (``parts``), which is also the source whose recording rules Prometheus loads.

A setting whose choices only one command knows keeps its enum beside that command's settings.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from gpuscope.contract import parts, profiles

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """A string setting's closed set of values.

    Members are their text (``Timing.OFF == "off"``, ``f"{Timing.OFF}"`` is ``off``), so they pass
    unchanged into labels, URLs, JSON and code that still compares text.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls: type[C], text: str) -> C:
        """The member spelled ``text``; ValueError naming every choice otherwise."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"invalid choice: {text!r} (choose from {cls.listing()})") from None

    @classmethod
    def listing(cls) -> str:
        """``'a', 'b', 'c'``: the accepted spellings, for messages."""
        return ", ".join(repr(member.value) for member in cls)


class MetricNames(Choice):
    """``--metrics.names``: gpuscope's own names, or vLLM's (names, labels, buckets of vLLM's V1 engine)."""

    GPUSCOPE = "gpuscope"
    VLLM = "vllm"


class AlertProfile(Choice):
    """``--stack.profile``: the alert rules as shipped, or the test profile's compressed windows."""

    PRODUCTION = profiles.PRODUCTION.name
    TEST = profiles.TEST.name


class ServerSource(Choice):
    """``--stack.source``: the server's metrics under gpuscope's names, or vLLM's (alerting.sources)."""

    #: gpuscope serve as it is, scraped as job gpuscope-server
    GPUSCOPE = parts.SERVER.job
    #: gpuscope serve --metrics.names vllm, scraped as job vllm: what the vLLM source's rules read
    VLLM = parts.VLLM.job
