"""Client-controlled text on its way into a log line: escaped and bounded.

A header, path or request line a client sent may hold newlines (a forged log line), terminal
escape sequences, or kilobytes of junk. :func:`quote` makes such text one printable line of at
most ``limit`` characters; :class:`EscapingFilter` does the same to every record a handler
passes on, so nothing a format string or a library puts into a message can break the one
record, one line rule (``%(message)s`` is then always a single line).
"""

from __future__ import annotations

import logging
import re

#: Characters written as escapes: C0 and C1 controls, DEL, and Unicode line and paragraph
#: separators (which some log viewers break lines at).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
#: Longest message a handler with :class:`EscapingFilter` passes on (a traceback, escaped, included).
MAX_MESSAGE = 16384


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def escape(text: str) -> str:
    """``text`` with every control character (newline included) written as a backslash escape."""
    return _UNSAFE.sub(_escape, text)


def quote(text: object, limit: int = 200) -> str:
    """Client text for a log line: escaped, at most ``limit`` characters of it, and the original length
    said when it was cut (``'abc…' (8192 chars)``)."""
    raw = text if isinstance(text, str) else str(text)
    shown = escape(raw[:limit])
    return f"'{shown}'" if len(raw) <= limit else f"'{shown}…' ({len(raw)} chars)"


class EscapingFilter(logging.Filter):
    """A handler filter: the record's message, exception text included, becomes one escaped line of
    at most MAX_MESSAGE characters. Attach it to a handler (a logger's filter misses its children)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            message = f"{message}\n{record.exc_text}"
        if record.stack_info:
            message = f"{message}\n{record.stack_info}"
        line = escape(message)
        if len(line) > MAX_MESSAGE:
            line = f"{line[:MAX_MESSAGE]}… ({len(line)} chars)"
        record.msg, record.args = line, None
        record.exc_info = record.exc_text = record.stack_info = None
        return True
