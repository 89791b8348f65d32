"""Server-sent events of an OpenAI-style streaming completion, and the timings they give.

The server sends ``data: {json}`` lines and ends with ``data: [DONE]``. Two
dialects reach this parser, and one rule covers both:

* vLLM's OpenAI server (``tests/loadtest/fixtures/`` holds its format): one
  chunk per engine step, ``choices[0].text`` the new text (empty for a special
  token or half a UTF-8 character); the chunk of the last step carries
  ``finish_reason`` (``length``, or ``stop`` at EOS or a stop string) *and* that
  step's text. With ``stream_options: {"include_usage": true}`` a last chunk
  follows with ``"choices": []`` and ``usage.completion_tokens``.
* gpuscope serve: a chunk per token that decodes to text; then a closing chunk
  with ``finish_reason``, the decoder's flush as ``text`` (usually empty) and
  ``usage`` on the same chunk.

Chat streams (``--api chat``) carry the text in ``choices[0].delta.content``; their opening chunk
(``delta`` with ``role`` and no content) is sent before any token and is not one. vLLM's and gpuscope
serve's chat streams both send one chunk per step, the last with ``finish_reason``.

A chunk with a choice is a token arrival, whatever its text, as in vLLM's
benchmark client: vLLM's last chunk
is its last step, even when that step's text is empty (the EOS token). The one
exception is a chunk with ``finish_reason`` and ``usage`` together: gpuscope
serve's closing summary, sent in the same step as its last token, whose text is
the decoder's flush of bytes that already arrived. A chunk without a choice
(vLLM's usage chunk) is never a token. The token count is
``usage.completion_tokens`` when the stream gives it, else the number of token
arrivals.

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
    """One completion chunk: its first choice's text and finish reason, and the usage's token count."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int | None = None
    #: False for a chunk without choices (vLLM's usage chunk, ``"choices": []``).
    has_choice: bool = True

    @property
    def is_token(self) -> bool:
        """Whether this chunk's arrival is a token arrival (see the module docstring)."""
        return self.has_choice and (self.finish_reason is None or self.completion_tokens is None)


def _error_message(chunk: dict) -> str | None:
    """The message of an error event: ``{"error": {...}}``, or older vLLM's ``{"object": "error", ...}``."""
    if "error" in chunk:
        error = chunk["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    if chunk.get("object") == "error":
        return str(chunk.get("message", chunk))
    return None


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
    message = _error_message(chunk)
    if message is not None:
        raise StreamError(f"server error in stream: {message}")
    usage = chunk.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
    choices = chunk.get("choices")
    if choices == []:  # vLLM's usage chunk; some gateways send one before the first token too
        return Chunk("", None, tokens, has_choice=False)
    try:
        choice = choices[0]
        finish = choice.get("finish_reason")
        delta = choice.get("delta")
        if isinstance(delta, dict):  # a chat chunk
            text = delta.get("content") or ""
            if "role" in delta and not text and finish is None:  # the opening chunk: no token yet
                return Chunk("", None, tokens, has_choice=False)
        else:
            text = choice.get("text") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        raise StreamError(f"chunk without choices[0].text or usage: {payload[:80]!r}") from None
    if not isinstance(text, str):
        raise StreamError(f"choices[0].text is not a string: {payload[:80]!r}")
    return Chunk(text, finish, tokens)


@dataclass
class StreamTiming:
    """Arrival times (``time.perf_counter`` seconds) of one streamed completion."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    ended: float | None = None
    reported_tokens: int | None = None
    finish_reason: str | None = None

    def token(self, now: float) -> None:
        self.token_times.append(now)

    def chunk(self, chunk: Chunk, now: float) -> None:
        """Account for one parsed chunk that arrived at ``now``."""
        if chunk.is_token or (chunk.has_choice and not self.token_times):
            # A stream whose only chunk with a choice is the last one still has a first token
            # (vLLM answers a stream it cannot stream, such as n > 1 with best_of, in one chunk).
            self.token(now)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.completion_tokens is not None:
            self.reported_tokens = chunk.completion_tokens

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
