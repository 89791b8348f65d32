"""Response bodies and stream chunks of the two generation APIs, in vLLM's (and OpenAI's) shapes.

``CompletionShape`` is ``/v1/completions`` (``object`` ``text_completion``), ``ChatShape`` is
``/v1/chat/completions`` (``chat.completion`` and ``chat.completion.chunk``), both as vLLM's
``protocol.py`` defines them and ``serving_chat.py`` streams them: the chat stream opens with a chunk
whose delta is ``{"role": "assistant", "content": ""}``, sends ``{"content": text}`` deltas, ends with
``finish_reason`` (and ``stop_reason``: the stop string that ended it, else null), then, with
``stream_options.include_usage``, one chunk with ``choices: []`` and ``usage``. Fields vLLM leaves
unset in a chunk are left out, as its ``model_dump_json(exclude_unset=True)`` does. Pure functions of
the engine's events: no aiohttp.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .engine import Done


def usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body``."""
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class CompletionShape:
    """``/v1/completions``: ``choices[0].text``; the last chunk carries ``finish_reason`` and ``usage``."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    #: Whether the last token's text rides in the finish chunk (vLLM's chat stream: one chunk per
    #: step) rather than in its own chunk before a closing summary that carries ``usage``.
    merges_last = False

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.include_usage = include_usage
        self.meta = {"id": f"{self.id_prefix}{uuid.uuid4().hex}", "object": self.object,
                     "created": int(time.time()), "model": model}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**self.meta, "object": self.chunk_object, "choices": choices, **extra}

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the first text."""
        return []

    def text(self, text: str) -> dict[str, Any]:
        return self._chunk([{"index": 0, "text": text, "finish_reason": None, "logprobs": None}])

    def closing(self, done: Done) -> list[dict[str, Any]]:
        choice = {"index": 0, "text": done.text_tail, "finish_reason": done.reason, "logprobs": None,
                  "stop_reason": done.stop_reason}
        return [self._chunk([choice], usage=usage(done))]

    def body(self, text: str, done: Done) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": done.reason, "logprobs": None,
                  "stop_reason": done.stop_reason}
        return {**self.meta, "choices": [choice], "usage": usage(done)}


class ChatShape(CompletionShape):
    """``/v1/chat/completions``: a role chunk, content deltas, the finish chunk, then the usage chunk."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    merges_last = True

    def opening(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])]

    def text(self, text: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return self._chunk([choice])

    def closing(self, done: Done) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"content": done.text_tail}, "logprobs": None,
                  "finish_reason": done.reason, "stop_reason": done.stop_reason}
        chunks = [self._chunk([choice])]
        if self.include_usage:
            chunks.append(self._chunk([], usage=usage(done)))
        return chunks

    def body(self, text: str, done: Done) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "tool_calls": []}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": done.reason,
                  "stop_reason": done.stop_reason}
        return {**self.meta, "choices": [choice], "usage": usage(done)}
