"""Which processes may join as which tenant (``--share.allow``).

A process asks to join as a tenant by name; the name alone proves nothing (any process can set
``GPUSCOPE_SHARE_TENANT``). The controller knows the joining process's pid, uid and gid from the
kernel (``SO_PEERCRED`` on the join socket) and honours the name only for the processes the policy
allows it:

    --share.allow online=uid:1001|group:serving,batch=cgroup:/system.slice/batch.service

Rules: ``uid:N``, ``user:NAME``, ``gid:N``, ``group:NAME`` (the process's primary or supplementary
groups), ``cgroup:PATH`` (the process's cgroup is PATH or below it, as the controller's cgroup
namespace shows it: a controller in the host's namespace sees services' and containers' cgroups; a
Kubernetes pod has its own namespace, so there uid and gid rules are the ones that match), ``any``.
A tenant not named in ``--share.allow`` admits processes of the controller's own user only, so that
shares are enforced between users only where the operator said who is who.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    """A joining process as the kernel reports it."""

    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Rule:
    kind: str  # uid, gid, cgroup, any
    value: int | str = ""

    def __str__(self) -> str:
        return self.kind if self.kind == "any" else f"{self.kind}:{self.value}"


def parse_rule(text: str) -> Rule:
    kind, sep, value = text.strip().partition(":")
    kind = kind.strip()
    value = value.strip()
    if kind == "any" and not sep:
        return Rule("any")
    if not sep or not value:
        raise ValueError(f"{text!r} is not uid:N, user:NAME, gid:N, group:NAME, cgroup:PATH or any")
    if kind in ("uid", "gid"):
        if not value.isdigit():
            raise ValueError(f"{text!r}: {kind} must be a number")
        return Rule(kind, int(value))
    if kind == "user":
        try:
            return Rule("uid", pwd.getpwnam(value).pw_uid)
        except KeyError:
            raise ValueError(f"{text!r}: no user named {value!r} on this host") from None
    if kind == "group":
        try:
            return Rule("gid", grp.getgrnam(value).gr_gid)
        except KeyError:
            raise ValueError(f"{text!r}: no group named {value!r} on this host") from None
    if kind == "cgroup":
        if not value.startswith("/"):
            raise ValueError(f"{text!r}: a cgroup path starts with /")
        return Rule("cgroup", value.rstrip("/") or "/")
    raise ValueError(f"{text!r} is not uid:N, user:NAME, gid:N, group:NAME, cgroup:PATH or any")


def parse_allow(text: str) -> dict[str, tuple[Rule, ...]]:
    """``NAME=RULE[|RULE...],...`` → tenant name → rules."""
    out: dict[str, tuple[Rule, ...]] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, rules = item.partition("=")
        name = name.strip()
        if not sep or not name or not rules.strip():
            raise ValueError(f"{item!r} is not NAME=RULE[|RULE...]")
        if name in out:
            raise ValueError(f"tenant {name!r} named twice in --share.allow")
        out[name] = tuple(parse_rule(r) for r in rules.split("|"))
    return out


def process_groups(pid: int) -> set[int]:
    """The supplementary groups of ``pid`` (from /proc; empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def process_cgroups(pid: int) -> list[str]:
    """The cgroup paths of ``pid`` (v2's single line, or every v1 hierarchy's)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return [line.rstrip("\n").split(":", 2)[2] for line in f if line.count(":") >= 2]
    except OSError:
        return []


def _under(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def matches(rule: Rule, peer: Peer) -> bool:
    if rule.kind == "any":
        return True
    if rule.kind == "uid":
        return peer.uid == rule.value
    if rule.kind == "gid":
        return peer.gid == rule.value or rule.value in process_groups(peer.pid)
    return any(_under(path, str(rule.value)) for path in process_cgroups(peer.pid))


class Access:
    """The tenants' admission rules (``own_uid``: the controller's user, whom the default rule admits)."""

    def __init__(self, allow: dict[str, tuple[Rule, ...]] | None = None, *,
                 own_uid: int | None = None) -> None:
        self.allow = dict(allow or {})
        self.default = (Rule("uid", os.geteuid() if own_uid is None else own_uid),)

    def rules(self, tenant: str) -> tuple[Rule, ...]:
        return self.allow.get(tenant, self.default)

    def admits(self, tenant: str, peer: Peer) -> bool:
        return any(matches(rule, peer) for rule in self.rules(tenant))

    def describe(self, tenant: str) -> str:
        return "|".join(str(r) for r in self.rules(tenant))
