"""Pipelined requests before a malformed one are answered, in order, before its 4xx.

aiohttp's request parser turns a whole chunk of bytes into requests at once, and when one request
in the chunk is malformed (a header over the limit, bad syntax) it raises for the chunk: the requests
before it, parsed from the same chunk, are lost, and the client gets only the error, for a request
it sent later. :class:`OrderedParser` wraps the parser and feeds it a chunk in pieces, each ending
where a request's head can end (a blank line), so that what raises holds only the bad request and
what follows it; the requests before it are queued as usual and the error after them, which the
connection answers, then closes.

It keeps the parser's queue bound too: once as many requests wait as the connection queues at most,
the rest of the chunk waits here, unparsed, until the connection asks for more.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web_protocol
from aiohttp.http_exceptions import HttpProcessingError

#: aiohttp's record of a request its parser rejected (private; in every aiohttp 3.x tested here). An
#: aiohttp without it keeps its own behaviour: the server says nothing, requests are still answered.
SUPPORTED = hasattr(web_protocol, "_ErrInfo") and hasattr(web_protocol, "EMPTY_PAYLOAD")
#: Where a request's head can end: a blank line (``\r\n\r\n``, or ``\n\n`` that lax parsers accept).
_BLANK_LINE = re.compile(rb"\n\r?\n")
#: Pieces a chunk is cut into at most; the rest is fed whole. A body full of blank lines must not
#: cost a parser call for each.
MAX_PIECES = 64

Feed = tuple[list[tuple[Any, Any]], bool, bytes]


class OrderedParser:
    """aiohttp's request parser, fed a request head at a time (module docstring). ``queue_limit``: the
    requests the connection queues at most before it stops reading (0: no limit)."""

    def __init__(self, parser: Any, queue_limit: int) -> None:
        self._parser = parser
        self._limit = queue_limit
        self._queued = 0  # requests handed out and not consumed yet, as the parser counts them
        self._held = b""  # bytes not fed yet: the queue was full
        self._last = b""  # the last 2 bytes fed, for a blank line split between two chunks
        self._failed = False

    def feed_data(self, data: bytes, *args: Any, **kwargs: Any) -> Feed:
        if self._failed:  # the connection closes after answering the error; nothing more is parsed
            return [], False, b""
        if self._held:
            data, self._held = self._held + data, b""
        messages: list[tuple[Any, Any]] = []
        start = fed = 0
        while True:
            if self._limit and self._queued >= self._limit and start < len(data):
                self._held = data[start:]  # parsed when the connection has room again (it asks, b"")
                break
            # An empty call goes through too: it resumes a body the parser was told to pause.
            end = self._cut(data, start) if fed < MAX_PIECES - 1 else len(data)
            piece = data[start:end]
            try:
                parsed, upgraded, tail = self._parser.feed_data(piece, *args, **kwargs)
            except HttpProcessingError as exc:
                self._failed = True
                if messages and not messages[-1][1].is_eof():
                    # The error is in this request's body (its chunk framing, say): it is the bad one,
                    # answered by the error instead, as aiohttp would have.
                    messages.pop()
                if not messages:
                    raise  # aiohttp answers it as it always has
                error = web_protocol._ErrInfo(status=400, exc=exc, message=exc.message)
                messages.append((error, web_protocol.EMPTY_PAYLOAD))
                return messages, False, b""
            fed += 1
            self._last = (self._last + piece)[-2:]
            messages.extend(parsed)
            self._queued += len(parsed)
            start = end
            if upgraded:
                return messages, True, tail + data[start:]
            if start >= len(data):
                break
        return messages, False, b""

    def _cut(self, data: bytes, start: int) -> int:
        """Where the piece of ``data`` from ``start`` ends: just after its first blank line, else at the
        end of ``data``."""
        if start < 2:  # a blank line may have begun in the bytes fed before
            joined = self._last + data[:3]
            for match in _BLANK_LINE.finditer(joined):
                if match.end() - len(self._last) > start:
                    return match.end() - len(self._last)
        for match in _BLANK_LINE.finditer(data, max(0, start - 2)):
            if match.end() > start:
                return match.end()
        return len(data)

    def message_consumed(self) -> None:
        if self._queued > 0:
            self._queued -= 1
        self._parser.message_consumed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)
