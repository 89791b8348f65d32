"""Locust command-line options that gpuscope's locustfile adds, and the workload they describe.

Every option has an environment variable ``GPUSCOPE_LOAD_<NAME>`` (the ``LOAD_``
keeps them apart from ``gpuscope serve``'s flags, which read ``GPUSCOPE_<FLAG>``
and may share an environment with Locust in compose). Values travel from the
master to workers as plain strings (Locust sends custom options with msgpack),
so each is validated here as a string and parsed again where it is used.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuscope.contract.tenants import NAME_RULE, valid_tenant_name
from gpuscope.loadtest.distributions import LengthDistribution, parse_distribution
from gpuscope.loadtest.shapes import shape_names

DEFAULT_PROMPT_TOKENS = "lognormal:median=64,sigma=0.5,min=8,max=256"
DEFAULT_OUTPUT_TOKENS = "uniform:min=16,max=64"
DEFAULT_SEED = 1234
#: The OpenAI API the users drive: ``completions`` (``prompt``) or ``chat`` (``messages``).
APIS = ("completions", "chat")
DEFAULT_API = "completions"
#: Tenants and their weights (users of each tenant ∝ weight); ``name:weight,...``. The default
#: is gpuscope serve's default tenant; name the tenants the server was started with.
DEFAULT_TENANTS = "default:1"
TENANTS_ENV = "GPUSCOPE_LOAD_TENANTS"


def _string_option(check: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse ``type`` that validates with ``check`` (its ValueError is the user's one error
    line) and keeps the string itself: options reach Locust's workers as strings."""

    def option_type(raw: str) -> str:
        try:
            check(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return raw

    option_type.__name__ = getattr(check, "__name__", "value")
    return option_type


def _known_shape(name: str) -> None:
    if name not in shape_names():
        raise ValueError(f"unknown shape {name!r} (one of: {', '.join(shape_names())})")


def _known_api(name: str) -> None:
    if name not in APIS:
        raise ValueError(f"unknown API {name!r} (one of: {', '.join(APIS)})")


def _temperature(raw: str) -> None:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"temperature {raw!r} is not a number") from None
    if not 0 <= value <= 2:
        raise ValueError(f"temperature {raw!r} is outside 0..2")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(raw: str | bool) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) → bool; raises ValueError otherwise."""
    if isinstance(raw, bool):
        return raw
    lowered = str(raw).strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ValueError(f"{raw!r} is not true or false")


_checked_distribution = _string_option(parse_distribution)
_checked_shape = _string_option(_known_shape)
_checked_temperature = _string_option(_temperature)
_checked_bool = _string_option(parse_bool)
_checked_api = _string_option(_known_api)


def add_locust_arguments(parser: Any) -> None:
    """Register gpuscope's options on Locust's parser (``init_command_line_parser``)."""
    parser.add_argument("--shape", type=_checked_shape, default="steady", env_var="GPUSCOPE_LOAD_SHAPE",
                        help=f"load shape: {', '.join(shape_names())} (scaled by -u and -t)")
    parser.add_argument("--prompt-tokens", type=_checked_distribution, default=DEFAULT_PROMPT_TOKENS,
                        env_var="GPUSCOPE_LOAD_PROMPT_TOKENS",
                        help="prompt length distribution (ASCII characters: tokens for gpuscope serve)")
    parser.add_argument("--output-tokens", type=_checked_distribution, default=DEFAULT_OUTPUT_TOKENS,
                        env_var="GPUSCOPE_LOAD_OUTPUT_TOKENS", help="max_tokens distribution")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, env_var="GPUSCOPE_LOAD_SEED",
                        help="seed of every user's prompt and length draws")
    parser.add_argument("--temperature", type=_checked_temperature, default="0",
                        env_var="GPUSCOPE_LOAD_TEMPERATURE", help="sampling temperature sent to the server")
    parser.add_argument("--model", default="", env_var="GPUSCOPE_LOAD_MODEL",
                        help="model name sent in every request (default: the first one the host's "
                             "GET /v1/models lists)")
    parser.add_argument("--ignore-eos", type=_checked_bool, default="true",
                        env_var="GPUSCOPE_LOAD_IGNORE_EOS",
                        help="send ignore_eos (vLLM generates exactly max_tokens); false for servers "
                             "that reject unknown fields")
    parser.add_argument("--api", type=_checked_api, default=DEFAULT_API, env_var="GPUSCOPE_LOAD_API",
                        help="completions (POST /v1/completions, a prompt) or chat (POST "
                             "/v1/chat/completions, the prompt as one user message)")
    parser.add_argument("--samples-file", default="", env_var="GPUSCOPE_LOAD_SAMPLES_FILE",
                        include_in_web_ui=False,
                        help="write exact per-request figures (JSON) here when Locust quits")


@dataclass(frozen=True)
class Workload:
    """What each request looks like, parsed from the options."""

    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    seed: int
    temperature: float
    #: Model name sent; "" = the first one the host lists (resolved by the user), or none at all.
    model: str = ""
    ignore_eos: bool = True
    api: str = DEFAULT_API

    def request_body(self, rng: random.Random, model: str | None = None) -> dict[str, Any]:
        """The next streaming completion request of a user drawing from ``rng``.

        The fields are those of vLLM's ``CompletionRequest``; ``ignore_eos`` is vLLM's own
        sampling parameter (generate ``max_tokens`` whatever the model says), and
        ``stream_options.include_usage`` asks for the final usage chunk, whose
        ``completion_tokens`` is the token count. ``model`` overrides the workload's.
        """
        body: dict[str, Any] = {}
        name = self.model if model is None else model
        if name:
            body["model"] = name
        prompt = make_prompt(rng, self.prompt_tokens.draw(rng))
        if self.api == "chat":  # vLLM's ChatCompletionRequest: the same prompt as one user message
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body.update({
            "max_tokens": self.output_tokens.draw(rng),
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        })
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    @classmethod
    def from_options(cls, options: Any) -> Workload:
        """From Locust's parsed options; defaults where an option is absent (library use, tests)."""
        def get(name: str, default: Any) -> Any:
            value = getattr(options, name, None) if options is not None else None
            return default if value is None else value

        return cls(
            prompt_tokens=parse_distribution(get("prompt_tokens", DEFAULT_PROMPT_TOKENS)),
            output_tokens=parse_distribution(get("output_tokens", DEFAULT_OUTPUT_TOKENS)),
            seed=int(get("seed", DEFAULT_SEED)),
            temperature=float(get("temperature", 0)),
            model=str(get("model", "")).strip(),
            ignore_eos=parse_bool(get("ignore_eos", "true")),
            api=str(get("api", DEFAULT_API)),
        )


#: Words prompts are made of: plain ASCII, so a byte-level tokenizer (gpuscope serve's) sees one
#: token per character and a prompt of n characters is n tokens.
_VOCABULARY = (
    "the", "of", "and", "to", "in", "is", "that", "for", "on", "with", "as", "by", "at", "from",
    "this", "be", "are", "it", "an", "or", "was", "which", "all", "graph", "kernel", "memory",
    "tensor", "stream", "event", "device", "queue", "batch", "token", "layer", "model", "cache",
    "latency", "budget", "tenant", "share", "region", "sample", "window", "scrape", "alert",
    "metric", "node", "driver",
)


def make_prompt(rng: random.Random, chars: int) -> str:
    """Text of exactly ``chars`` ASCII characters, from random words."""
    words = rng.choices(_VOCABULARY, k=chars // 2 + 1)  # words are >= 2 chars with their space
    return " ".join(words)[:chars]


def user_seed(base: int, process: int, number: int) -> str:
    """Seed of one simulated user: the nth user started by a Locust process.

    A string seed hashes the same way in every process and Python run, so the
    same run seed gives the same requests whatever the process layout's timing.
    """
    return f"gpuscope-{base}-{process}-{number}"




def tenant_class_name(tenant: str) -> str:
    """``alpha`` → ``TenantAlpha``; ``low-prio`` → ``TenantLowPrio``; ``a.b`` → ``TenantAB`` (what Locust's
    UI lists)."""
    return "Tenant" + "".join(part.capitalize() for part in re.split(r"[-_.]", tenant))


def parse_tenants(spec: str) -> dict[str, float]:
    """``alpha:3,beta:1`` → {"alpha": 3.0, "beta": 1.0}; raises ValueError with a one-line reason."""
    tenants: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, weight = item.partition(":")
        if not valid_tenant_name(name):  # the server's rule: the names must be ones it can serve
            raise ValueError(f"tenant name {name!r} must be {NAME_RULE}")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"tenant {name!r}: weight {weight!r} is not a number") from None
        if value <= 0 or name in tenants:
            raise ValueError(f"tenant {name!r}: weights must be positive and names unique")
        tenants[name] = value
    if not tenants:
        raise ValueError("no tenants given")
    return tenants


def tenants_from_env() -> dict[str, float]:
    """Tenants for the locustfile's user classes, which must exist before Locust parses options.

    A bad value ends the process with one line, as a bad flag does.
    """
    raw = os.environ.get(TENANTS_ENV, DEFAULT_TENANTS)
    try:
        return parse_tenants(raw)
    except ValueError as exc:
        sys.stderr.write(f"locust: error: {TENANTS_ENV}={raw!r}: {exc}\n")
        raise SystemExit(2) from None
