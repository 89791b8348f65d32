"""Length distributions for prompts and outputs, written as short specs.

A spec is ``KIND:PARAM=VALUE,...``, for example::

    fixed:n=128
    uniform:min=16,max=256
    normal:mean=128,sd=32,min=8,max=512
    lognormal:median=96,sigma=0.6,min=8,max=1024
    choice:values=32/128/512,weights=5/3/1

Every draw is an integer clipped to ``[min, max]`` (``min`` defaults to 1), so a
tail never asks the server for a zero-length or runaway request. Draws use the
``random.Random`` the caller passes, which is how a load test stays reproducible:
each simulated user gets its own generator seeded from the run's seed.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field

_KINDS: dict[str, tuple[set[str], set[str]]] = {
    # kind: (required params, optional params)
    "fixed": ({"n"}, set()),
    "uniform": ({"min", "max"}, set()),
    "normal": ({"mean", "sd"}, {"min", "max"}),
    "lognormal": ({"median", "sigma"}, {"min", "max"}),
    "choice": ({"values"}, {"weights"}),
}


@dataclass(frozen=True)
class LengthDistribution:
    """A parsed spec: ``draw(rng)`` returns one length."""

    kind: str
    params: dict[str, float] = field(default_factory=dict)
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    spec: str = ""

    @property
    def low(self) -> int:
        if self.kind == "choice":
            return min(self.values)
        return int(self.params.get("min", self.params.get("n", 1)))

    @property
    def high(self) -> int:
        if self.kind == "choice":
            return max(self.values)
        return int(self.params.get("max", self.params.get("n", 1 << 30)))

    def draw(self, rng: random.Random) -> int:
        """One length from this distribution, clipped to its bounds."""
        p = self.params
        if self.kind == "fixed":
            return int(p["n"])
        if self.kind == "uniform":
            return rng.randint(int(p["min"]), int(p["max"]))
        if self.kind == "choice":
            return rng.choices(self.values, weights=self.weights or None)[0]
        if self.kind == "normal":
            raw = rng.gauss(p["mean"], p["sd"])
        else:  # lognormal: median = exp(mu)
            raw = rng.lognormvariate(math.log(p["median"]), p["sigma"])
        return max(self.low, min(self.high, round(raw)))

    def __str__(self) -> str:
        return self.spec


def parse_distribution(spec: str) -> LengthDistribution:
    """Parse ``KIND:PARAM=VALUE,...``; raises ValueError with a one-line reason."""
    kind, _, rest = spec.strip().partition(":")
    if kind not in _KINDS:
        raise ValueError(f"{spec!r}: unknown distribution {kind!r} (one of: {', '.join(_KINDS)})")
    required, optional = _KINDS[kind]
    raw: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in required | optional:
            allowed = ", ".join(sorted(required | optional))
            raise ValueError(f"{spec!r}: bad parameter {item!r} for {kind} (takes {allowed})")
        raw[key] = value
    missing = required - raw.keys()
    if missing:
        raise ValueError(f"{spec!r}: {kind} needs {', '.join(sorted(missing))}")
    if kind == "choice":
        return _parse_choice(spec, raw)
    try:
        params = {key: float(value) for key, value in raw.items()}
    except ValueError:
        raise ValueError(f"{spec!r}: parameters must be numbers") from None
    params.setdefault("min", params.get("n", 1.0))
    dist = LengthDistribution(kind, params, spec=spec.strip())
    if dist.low < 1 or dist.high < dist.low:
        raise ValueError(f"{spec!r}: need 1 <= min <= max")
    if kind in ("normal", "lognormal") and (params.get("sd", 1) <= 0 or params.get("sigma", 1) <= 0):
        raise ValueError(f"{spec!r}: spread must be positive")
    if kind == "lognormal" and params["median"] <= 0:
        raise ValueError(f"{spec!r}: median must be positive")
    return dist


def _parse_choice(spec: str, raw: dict[str, str]) -> LengthDistribution:
    try:
        values = tuple(int(v) for v in raw["values"].split("/"))
        weights = tuple(float(w) for w in raw["weights"].split("/")) if "weights" in raw else ()
    except ValueError:
        raise ValueError(f"{spec!r}: values are integers and weights numbers, separated by '/'") from None
    if min(values) < 1:
        raise ValueError(f"{spec!r}: lengths must be >= 1")
    if weights and (len(weights) != len(values) or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"{spec!r}: one non-negative weight per value, not all zero")
    return LengthDistribution("choice", values=values, weights=weights, spec=spec.strip())


def distribution_arg(spec: str) -> LengthDistribution:
    """argparse ``type=``: turns the ValueError into argparse's one-line error."""
    try:
        return parse_distribution(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

