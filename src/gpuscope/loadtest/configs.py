"""The server configurations the comparison command sets side by side.

Each set varies one thing and keeps the rest at ``gpuscope serve``'s defaults
plus the command's ``--server-args``:

* ``timing``: the kernel timer off, at its default overhead budget, and timing
  every region (``--timing off|budget|all``);
* ``batching``: one request per model step, then dynamic batches of several
  sizes (``--no-batching``; ``--batch.max-size N``);
* ``scheduler``: first come first served against GPU-time shares, with two
  tenants of equal share where one sends three times the load of the other
  (``--scheduler fcfs|share``): shares should protect the lighter tenant.

Endpoints the command does not start (``--target NAME=URL[#MODEL]``) form one
more set, ``targets``: each is a configuration with a URL instead of server flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SETS = ("timing", "batching", "scheduler")
#: The set of ``--target`` endpoints; not a name ``--sets`` takes.
TARGETS_SET = "targets"
#: Tenants of the scheduler set: equal shares on the server, unequal load from Locust.
SHARE_TENANTS_SERVER = "alpha:0.5,beta:0.5"
SHARE_TENANTS_LOAD = "alpha:3,beta:1"
SINGLE_TENANT_LOAD = "default:1"


@dataclass(frozen=True)
class Config:
    """One configuration: how to start its server (a target: where it runs) and which tenants load it."""

    set: str
    label: str
    server_args: tuple[str, ...]
    load_tenants: str = SINGLE_TENANT_LOAD
    #: A target's root URL: the command loads it as it runs instead of starting gpuscope serve.
    url: str = ""
    #: A target's model (from ``#MODEL`` or its ``/v1/models``); "" for the servers the command starts.
    model: str = ""
    #: The API a target's URL named ("" = completions unless ``--load.api`` says otherwise).
    api: str = ""

    @property
    def is_target(self) -> bool:
        return bool(self.url)

    @property
    def key(self) -> str:
        """File-name-safe ``set-label``."""
        return f"{self.set}-{self.label}".replace("=", "").replace(" ", "_")


def build(sets: Sequence[str], batch_sizes: Sequence[int]) -> list[Config]:
    """Configurations of the chosen sets, in the order reports list them."""
    configs: list[Config] = []
    for name in sets:
        if name == "timing":
            configs += [Config("timing", mode, ("--timing", mode)) for mode in ("off", "budget", "all")]
        elif name == "batching":
            configs.append(Config("batching", "off", ("--no-batching",)))
            configs += [Config("batching", f"max{size}", ("--batching", "--batch.max-size", str(size)))
                        for size in batch_sizes]
        elif name == "scheduler":
            configs += [Config("scheduler", mode, ("--scheduler", mode, "--tenants", SHARE_TENANTS_SERVER),
                               SHARE_TENANTS_LOAD) for mode in ("fcfs", "share")]
        else:
            raise ValueError(f"unknown configuration set {name!r} (one of: {', '.join(SETS)}, or none)")
    return configs


def for_targets(targets: Sequence[tuple[str, ...]]) -> list[Config]:
    """One configuration per ``(name, url, model[, api])`` target, in the order given."""
    return [Config(TARGETS_SET, name, (), url=url, model=model, api=rest[0] if rest else "")
            for name, url, model, *rest in targets]
