"""``/v1/chat/completions`` requests: ``messages`` checked, and turned into a prompt by a chat template.

A ``--model.hf`` model's tokenizer renders its own chat template
(``apply_chat_template(..., add_generation_prompt=True)``) and, as vLLM does for chat, the rendered
prompt is tokenized without adding special tokens again (the template writes the BOS it wants;
``add_special_tokens`` in the body overrides, as in vLLM). The toy model, and a tokenizer without a
chat template, use the simple template below, documented in docs/server.md::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

one ``<|role|>`` line and the message's text per message, then ``<|assistant|>`` and a newline for the
answer. Message content is a string, or a list of ``{"type": "text", "text": ...}`` parts (joined with
newlines, vLLM's "string" content format); other part types (images, audio) get a 400.
"""

from __future__ import annotations

from typing import Any

from .config import ServerConfig
from .protocol import BadRequest, Completion, encode_prompt, parse_max_tokens, parse_sampling

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 1024


def simple_template(messages: list[dict[str, str]]) -> str:
    """The documented template of the toy model (and of tokenizers that have none)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class ChatTemplate:
    """Renders checked messages into prompt text: the tokenizer's template, else ``simple_template``."""

    def __init__(self, tokenizer: Any = None) -> None:
        has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        self._tokenizer = tokenizer if has_template else None
        #: A real tokenizer's template writes its special tokens; the simple one writes none.
        self.add_special_tokens = not has_template

    @property
    def name(self) -> str:
        return "tokenizer" if self._tokenizer is not None else "simple"

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._tokenizer is None:
            return simple_template(messages)
        try:
            text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that raises ("roles must alternate") rejects the messages
            message = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise BadRequest(400, f"the model's chat template rejected 'messages': {message}",
                             param="messages") from None
        if not isinstance(text, str):
            raise BadRequest(400, "the model's chat template did not render text", param="messages")
        return text


def template_for(runner: Any) -> ChatTemplate:
    """The chat template of a runner: its tokenizer's (``--model.hf``) or the simple one (toy model)."""
    return ChatTemplate(getattr(runner, "tokenizer", None))


def _content(value: Any, index: int, role: str) -> str:
    where = f"messages[{index}].content"
    if value is None:
        if role == "assistant":
            return ""
        raise BadRequest(400, f"'{where}' is required", param="messages")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts: list[str] = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(400, f"'{where}[{j}]' is of type {str(kind)[:40]!r}; only text parts are "
                                      "supported", param="messages")
            if not isinstance(part.get("text"), str):
                raise BadRequest(400, f"'{where}[{j}].text' must be a string", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRequest(400, f"'{where}' must be a string or a list of text parts", param="messages")


def parse_messages(value: Any) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with string content (400 on anything else)."""
    if not isinstance(value, list) or not value:
        raise BadRequest(400, "'messages' must be a non-empty list", param="messages")
    if len(value) > MAX_MESSAGES:
        raise BadRequest(400, f"'messages' has {len(value)} entries; at most {MAX_MESSAGES}",
                         param="messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadRequest(400, f"'messages[{i}]' must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            shown = role[:40] if isinstance(role, str) else type(role).__name__
            raise BadRequest(400, f"'messages[{i}].role' is {shown!r}; one of {', '.join(ROLES)}",
                             param="messages")
        messages.append({"role": role, "content": _content(message.get("content"), i, role)})
    return messages


def parse_chat(body: Any, config: ServerConfig, template: ChatTemplate) -> tuple[Completion, bool]:
    """Validate a /v1/chat/completions body: (the completion to run, whether to add special tokens).

    ``max_completion_tokens`` (or the older ``max_tokens``) bounds the answer; without either, the
    answer may fill the context up to ``--request.max-tokens``, as vLLM fills the context.
    """
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    if "messages" not in body:
        raise BadRequest(400, "missing required field 'messages'", param="messages")
    messages = parse_messages(body["messages"])
    temperature, stream, ignore_eos, stop, include_usage = parse_sampling(body, config)
    special = body.get("add_special_tokens", template.add_special_tokens)
    if not isinstance(special, bool):
        raise BadRequest(400, "'add_special_tokens' must be true or false", param="add_special_tokens")
    prompt = template.render(messages)
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    requested = body.get(param)
    if requested is not None:
        max_tokens = parse_max_tokens(requested, config, param)
    else:  # what the context leaves, up to the server's limit (at least 1: a full prompt fails below)
        room = config.model.context - len(prompt.encode("utf-8", "surrogatepass")) - 1
        max_tokens = max(1, min(config.max_tokens_limit, room))
    ids = encode_prompt(prompt, max_tokens, config, param="messages")
    return Completion(prompt, ids, max_tokens, temperature, stream, ignore_eos, stop, include_usage), special
