"""W3C ``tracestate`` validation (Trace Context, level 1, section 3.3); a pure function.

An invalid ``tracestate`` is dropped whole, as the spec asks of a vendor that cannot parse it, before
it reaches OpenTelemetry: its parser would log the client's raw text (up to 8 kB a request) through
a logger nobody configured, straight to stderr.
"""

from __future__ import annotations

import re

#: Members at most (the spec's limit).
MAX_MEMBERS = 32
#: Longest header kept, all its fields joined (OpenTelemetry's limit; the spec asks for at least 512).
MAX_LENGTH = 8192

_KEY = r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(f"({_KEY})=({_VALUE})")


def valid_tracestate(header: str) -> bool:
    """Whether ``header`` (every ``tracestate`` field of a request, joined with commas) is valid:
    list members ``key=value`` with the spec's characters, at most 32, no key twice."""
    if len(header) > MAX_LENGTH:
        return False
    keys: set[str] = set()
    for member in header.split(","):
        member = member.strip(" \t")
        if not member:
            continue  # empty members are allowed
        match = _MEMBER.fullmatch(member)
        if match is None or match.group(1) in keys:
            return False
        keys.add(match.group(1))
    return len(keys) <= MAX_MEMBERS
