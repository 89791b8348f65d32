"""Server-sent events of an OpenAI-style streaming completion, and the timings they give.

The server sends ``data: {json}`` lines, each chunk carrying ``choices[0].text``,
and ends with ``data: [DONE]``. A chunk without ``finish_reason`` is one token,
even when its text is empty (a byte-level tokenizer streams half a UTF-8
character as an empty string); the last chunk has the ``finish_reason`` and may
carry ``usage.completion_tokens``, which is the token count when present.

Timings follow vLLM's benchmark: TTFT is first token chunk − send, inter-token
latency is every gap between token chunks, end-to-end is last byte − send.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

DONE = object()


class StreamError(Exception):
    """The stream carried an error event or a chunk that is not a completion."""


@dataclass(frozen=True)
class Chunk:
    """One completion chunk: a token unless ``finish_reason`` is set."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int | None = None

    @property
    def is_token(self) -> bool:
        return self.finish_reason is None


def parse_sse_line(line: bytes | str) -> Chunk | object | None:
    """The chunk of one ``data:`` line, :data:`DONE` for the terminator, None for anything to skip.

    Blank lines, comments (``:``) and ``event:``/``id:`` fields carry no tokens.
    """
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError:
        raise StreamError(f"chunk is not JSON: {payload[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise StreamError(f"chunk is not an object: {payload[:80]!r}")
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"server error in stream: {message}")
    try:
        choice = chunk["choices"][0]
        text = choice.get("text") or ""
        finish = choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise StreamError(f"chunk without choices[0].text: {payload[:80]!r}") from None
    usage = chunk.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Chunk(text, finish, tokens if isinstance(tokens, int) else None)


@dataclass
class StreamTiming:
    """Arrival times (``time.perf_counter`` seconds) of one streamed completion."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    ended: float | None = None
    reported_tokens: int | None = None

    def token(self, now: float) -> None:
        self.token_times.append(now)

    def end(self, now: float) -> None:
        self.ended = now

    @property
    def tokens(self) -> int:
        """Output tokens: the server's own count when it gave one, else token chunks seen."""
        return len(self.token_times) if self.reported_tokens is None else self.reported_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def inter_token(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def e2e(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent
