"""The tenants' policy as operators write it: the ``--share`` flag, ``--share.allow``, or a policy file.

A policy file (``--share.policy-file``, a ConfigMap in Kubernetes) holds the same facts as the two
flags, in YAML (JSON is YAML too)::

    tenants:
      online: {share: 0.3, priority: 1, memory: 40GiB, allow: [uid:1001, "cgroup:/kubepods.slice"]}
      batch: {share: 0.7, memory: 0.5}

``tenants`` holds on every GPU the controller holds (``--share.gpus``); a ``gpus`` section gives a GPU,
by NVML index or UUID, tenants of its own instead (the same keys; a tenant's ``allow`` rules and
``gang`` mark hold on every GPU, so a section may leave them out, and may not contradict them)::

    gpus:
      1: {online: {share: 0.5}, batch: {share: 0.5}}
      GPU-5e0c6f8a-...: {batch: {share: 1}}

A ``gang: true`` tenant is one group across its GPUs (``gangs.py``: its ranks' turns are aligned).

Every form goes through one validation (``validate``): names, shares in (0, 1] summing to at most 1,
priorities, memory caps (a fraction of the card, or a size of at least 1 MiB) whose fractions sum to
at most the card, and admission rules (``access.parse_rule``). A file that fails it is refused with
one line saying why, and the policy in force stays.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import yaml

from gpuscope.share.access import Rule, parse_rule
from gpuscope.share.ledger import MAX_TENANTS, NAME_LEN, TenantPolicy

if TYPE_CHECKING:
    from gpuscope.share.gpus import Gpu

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
#: A memory cap below this is a typo (a unit forgotten), not a cap.
MIN_MEMORY_CAP = 2**20


def parse_memory(text: str) -> float:
    """A memory cap: a fraction of the card in (0, 1] (``0.4``), or a size (``40GiB``, ``512MB``,
    ``1073741824``) of at least 1 MiB."""
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)", str(text).strip())
    if match is None:
        raise ValueError(f"memory {text!r} is neither a fraction of the card (0.4) nor a size (40GiB)")
    value, unit = float(match.group(1)), match.group(2).upper()
    if unit not in _UNITS:
        raise ValueError(f"memory {text!r}: unknown unit {unit!r} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    if not unit and 0 < value <= 1:
        return value
    size = int(value * _UNITS[unit])
    if size < MIN_MEMORY_CAP:
        raise ValueError(f"memory {text!r}: a fraction of the card must be in (0, 1] and a size at "
                         "least 1MiB")
    return size


def check_name(name: object) -> str:
    """``name`` if it can name a tenant (it fits the ledger's entry), else ValueError."""
    if not isinstance(name, str) or not 0 < len(name.encode()) < NAME_LEN or \
            not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"tenant name {name!r}: letters, digits, '-', '_', '.', under {NAME_LEN} bytes")
    return name


def validate(tenants: list[TenantPolicy]) -> list[TenantPolicy]:
    """``tenants`` if they make a policy, else ValueError saying what is wrong."""
    names: set[str] = set()
    for t in tenants:
        check_name(t.name)
        if t.name in names:
            raise ValueError(f"tenant {t.name!r} named twice")
        names.add(t.name)
        if not 0 < t.share <= 1:
            raise ValueError(f"tenant {t.name!r}: the share must be in (0, 1], not {t.share:g}")
        if not 0 <= t.priority <= 1000:
            raise ValueError(f"tenant {t.name!r}: the priority must be between 0 and 1000, not {t.priority}")
    if not tenants:
        raise ValueError("no tenants: give NAME=FRACTION[:PRIORITY[:MEMORY]],...")
    if len(tenants) > MAX_TENANTS:
        raise ValueError(f"at most {MAX_TENANTS} tenants")
    if sum(t.share for t in tenants) > 1.0 + 1e-9:
        raise ValueError(f"the shares add up to {sum(t.share for t in tenants):g}, more than 1")
    fractions = [t.memory for t in tenants if 0 < t.memory <= 1]
    if sum(fractions) > 1.0 + 1e-9:
        raise ValueError(f"the memory fractions add up to {sum(fractions):g}, more than the card")
    return tenants


def parse_shares(text: str) -> list[TenantPolicy]:
    """``NAME=FRACTION[:PRIORITY[:MEMORY]],...`` → tenants."""
    tenants: list[TenantPolicy] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, rest = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{item!r} is not NAME=FRACTION[:PRIORITY[:MEMORY]]")
        fraction, _, tail = rest.partition(":")
        priority, _, memory = tail.partition(":")
        try:
            share = float(fraction)
            prio = int(priority) if priority.strip() else 0
        except ValueError:
            raise ValueError(f"{item!r}: FRACTION must be a number and PRIORITY an integer") from None
        tenants.append(TenantPolicy(name.strip(), share, prio, parse_memory(memory) if memory.strip() else 0))
    return validate(tenants)


@dataclass(frozen=True)
class PolicySpec:
    """What a policy file says: the tenants and, for those that name any, their admission rules; and
    the GPUs (by NVML index or UUID, as written) that have tenants of their own."""

    tenants: list[TenantPolicy]
    allow: dict[str, tuple[Rule, ...]]
    gpus: dict[str, list[TenantPolicy]] = field(default_factory=dict)

    def for_gpu(self, gpu: Gpu) -> list[TenantPolicy]:
        """The tenants on ``gpu``: its own section's (by UUID, then index), else ``tenants``."""
        for key in (gpu.uuid, str(gpu.index)):
            if key and key in self.gpus:
                return self.gpus[key]
        return self.tenants

    def on_gpu(self, gpu: Gpu) -> PolicySpec:
        """The policy of one GPU's controller."""
        return PolicySpec(self.for_gpu(gpu), self.allow)

    def check_gpus(self, gpus: list[Gpu]) -> None:
        """ValueError when a GPU section names a GPU not among ``gpus`` (a typo would leave the GPU it
        meant on the default shares), or two sections name one GPU."""
        for key in self.gpus:
            held = [g for g in gpus if key in (g.uuid, str(g.index))]
            if not held:
                names = ", ".join(g.name + (f" ({g.uuid})" if g.uuid and g.uuid != g.name else "")
                                  for g in gpus)
                raise ValueError(f"gpus: {key} is not a GPU this controller holds ({names})")
        for g in gpus:
            if g.uuid and g.uuid in self.gpus and str(g.index) in self.gpus:
                raise ValueError(f"gpus: GPU {g.index} has two sections ({g.index} and {g.uuid})")


def with_gangs(tenants: list[TenantPolicy], gangs: set[str]) -> list[TenantPolicy]:
    """``tenants`` with those named in ``gangs`` marked as gangs (``--share.gang``)."""
    return [replace(t, gang=t.gang or t.name in gangs) for t in tenants]


def _gpu_key(key: object) -> str:
    text = str(key).strip()
    if text.isdigit() or text.startswith(("GPU-", "MIG-")):
        return text
    raise ValueError(f"gpus: {key!r} is neither an NVML index (0) nor a GPU UUID (GPU-...)")


def _tenants_section(where: str, section: object, allow: dict[str, tuple[Rule, ...]],
                     gangs: dict[str, bool]) -> list[TenantPolicy]:
    """One mapping of tenants (``tenants``, or a GPU's section): their policies; their admission rules
    and gang marks go into ``allow`` and ``gangs``, which every section must agree on."""
    if not isinstance(section, dict) or not section:
        raise ValueError(f"{where}: expected a mapping {{NAME: {{share: ..., priority: ..., memory: ..., "
                         "allow: [...], gang: ...}}")
    tenants = []
    for name, entry in section.items():
        if not isinstance(entry, dict):
            raise ValueError(f"tenant {name!r}: expected a mapping such as {{share: 0.5}}")
        extra = set(entry) - {"share", "priority", "memory", "allow", "gang"}
        if extra:
            raise ValueError(f"tenant {name!r}: unknown keys {sorted(extra)} (share, priority, memory, "
                             "allow, gang)")
        try:
            share = float(entry.get("share", "none"))
            priority = int(entry.get("priority", 0))
        except (TypeError, ValueError):
            raise ValueError(f"tenant {name!r}: share must be a number and priority an integer") from None
        memory = parse_memory(entry["memory"]) if entry.get("memory") not in (None, 0, "") else 0
        if "gang" in entry:
            if not isinstance(entry["gang"], bool):
                raise ValueError(f"tenant {name!r}: gang must be true or false")
            if gangs.setdefault(str(name), entry["gang"]) != entry["gang"]:
                raise ValueError(f"tenant {name!r}: gang is {entry['gang']} in {where} and not elsewhere")
        tenants.append(TenantPolicy(str(name), share, priority, memory))
        rules = entry.get("allow")
        if rules is not None:
            if not isinstance(rules, list) or not rules:
                raise ValueError(f"tenant {name!r}: allow must be a list of rules such as [uid:1001]")
            parsed = tuple(parse_rule(str(r)) for r in rules)
            if allow.setdefault(str(name), parsed) != parsed:
                raise ValueError(f"tenant {name!r}: allow differs between {where} and another section")
    return tenants


def parse_policy(text: str) -> PolicySpec:
    """A policy file's text → PolicySpec (ValueError with one line on anything wrong)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict):
        raise ValueError("expected a mapping with 'tenants': {NAME: {share: ..., priority: ..., memory: ..., "
                         "allow: [...]}}")
    unknown = set(doc) - {"tenants", "gpus"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (only 'tenants' and 'gpus')")
    allow: dict[str, tuple[Rule, ...]] = {}
    gangs: dict[str, bool] = {}
    tenants = _tenants_section("tenants", doc["tenants"], allow, gangs)
    sections = doc.get("gpus") or {}
    if not isinstance(sections, dict):
        raise ValueError("gpus: expected a mapping {INDEX or UUID: {NAME: {share: ...}}}")
    gpus = {}
    for key, section in sections.items():
        where = f"gpus: {_gpu_key(key)}"
        if _gpu_key(key) in gpus:
            raise ValueError(f"{where} named twice")
        gpus[_gpu_key(key)] = _tenants_section(where, section, allow, gangs)
    marked = {name for name, gang in gangs.items() if gang}
    tenants = validate(with_gangs(tenants, marked))
    for key in gpus:
        try:
            gpus[key] = validate(with_gangs(gpus[key], marked))
        except ValueError as exc:
            raise ValueError(f"gpus: {key}: {exc}") from None
    return PolicySpec(tenants, allow, gpus)


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_trusted(path: str, st: os.stat_result) -> None:
    """ValueError unless only root or the controller's user could have written the policy at ``path``
    (``st``: the opened file's own status): the file, and the folders its name and its target are in,
    writable by nobody else, or on a read-only mount (a Kubernetes ConfigMap: its folder is open to
    all, but read-only to everyone in the pod). A policy another user can write is another user's."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a plain file")
    if (st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022) and not _read_only_mount(path):
        raise ValueError(f"{path} could be written by another user (owner uid {st.st_uid}, mode "
                         f"{stat.S_IMODE(st.st_mode):o}): only root or the controller's user may write it")
    for folder in {os.path.dirname(os.path.abspath(path)), os.path.dirname(os.path.realpath(path))}:
        dst = os.stat(folder)
        shared = dst.st_mode & 0o022 and not dst.st_mode & stat.S_ISVTX
        if (dst.st_uid not in (0, os.geteuid()) or shared) and not _read_only_mount(folder):
            raise ValueError(f"{folder} lets another user replace {os.path.basename(path)}: keep the policy "
                             "in a folder only root or the controller's user can write")


class PolicyFile:
    """A policy file watched for changes (a ConfigMap update swaps a symlink: the target is compared)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def read(self) -> PolicySpec:
        """Parse it now (ValueError with one line when it cannot be read, could have been written by
        another user, or is not a policy)."""
        self._seen = self._identity()
        try:
            # O_NONBLOCK: a FIFO put in the file's place cannot hang the controller's loop
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"cannot read {self.path}: {exc.strerror}") from None
        with os.fdopen(fd) as f:
            check_trusted(self.path, os.fstat(fd))
            text = f.read(1 << 20)
        return parse_policy(text)

    def changed(self) -> bool:
        """Whether the file is another one than at the last read."""
        return self._identity() != self._seen
