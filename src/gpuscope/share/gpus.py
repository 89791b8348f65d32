"""The GPUs one ``gpuscope share`` controller holds (``--share.gpus``): every GPU of the node, or some
(by NVML index or UUID; a MIG instance, its own GPU to CUDA, by its ``MIG-`` UUID).

Each GPU has a ledger of its own; a tenant process joins the ledger of the GPU its context runs on,
named in its hello by the UUID the driver gives it, which is the UUID NVML gives the controller. Where
NVML cannot be read (a CPU host, a container without the driver's library) the controller holds one
GPU whose UUID it does not know, and takes every process as that GPU's: the one-GPU controller as it
always was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuscope.share.joins import parse_uuid

#: ``--share.gpus``: every GPU NVML lists.
ALL = "all"


#: The index of a GPU named by UUID alone (a MIG instance): NVML's list of GPUs does not hold it.
NO_INDEX = -1


@dataclass(frozen=True)
class Gpu:
    """One GPU the controller holds: its NVML index and UUID (``""``: unknown, no NVML); a MIG instance
    has its UUID alone (``NO_INDEX``)."""

    index: int
    uuid: str = ""

    @property
    def uuid_bytes(self) -> bytes:
        return parse_uuid(self.uuid) if self.uuid else b""

    @property
    def label(self) -> str:
        """The ``gpu`` label of its metrics (a MIG instance's: empty; its ``uuid`` names it)."""
        return "" if self.index == NO_INDEX else str(self.index)

    @property
    def name(self) -> str:
        return self.uuid if self.index == NO_INDEX else str(self.index)


def _gpu_item(part: str) -> int | str:
    part = part.strip()
    if part.startswith(("GPU-", "MIG-")):
        parse_uuid(part)  # ValueError when it is not one
        return part
    index = int(part)
    if index < 0:
        raise ValueError(part)
    return index


def parse_gpus(text: str) -> str | tuple[int | str, ...]:
    """``all``, or GPUs by NVML index or UUID (``0,1``, ``GPU-...``, a MIG instance's ``MIG-...``), each
    once."""
    text = str(text).strip()
    if text == ALL:
        return ALL
    usage = (f"--share.gpus takes 'all', NVML indices such as 0,1 or UUIDs (GPU-..., MIG-...), each once, "
             f"not {text!r}")
    try:
        items = tuple(_gpu_item(part) for part in text.split(","))
    except ValueError:
        raise ValueError(usage) from None
    if not items or len(set(items)) != len(items):
        raise ValueError(usage)
    return items


def nvml_uuids() -> list[str]:
    """The node's GPUs' UUIDs, by NVML index."""
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    return out


def select(wanted: str | tuple[int | str, ...], uuids: Callable[[], list[str]] = nvml_uuids,
           log: Callable[[str], None] | None = None) -> list[Gpu]:
    """The GPUs ``--share.gpus`` names. Without NVML: one GPU of unknown UUID (the first index asked
    for), which takes every tenant process. ValueError for an index or a GPU UUID NVML does not list.
    A MIG instance (``MIG-...``) is taken as named: NVML lists whole GPUs."""
    try:
        known = uuids()
    except Exception as exc:  # no NVML: one GPU, as before there were several
        first = next((i for i in wanted if isinstance(i, int)), 0) if wanted != ALL else 0
        by_uuid = [g for g in wanted if isinstance(g, str)] if wanted != ALL else []
        if by_uuid:  # named by UUID: nothing to look up
            return [Gpu(NO_INDEX, u) for u in by_uuid]
        if log is not None:
            log(f"gpuscope share: NVML cannot list the GPUs ({exc}): holding one GPU, whichever each tenant "
                "process uses")
        return [Gpu(first)]
    if wanted == ALL:
        if not known:
            raise ValueError("NVML lists no GPU")
        return [Gpu(i, u) for i, u in enumerate(known)]
    out = []
    for item in wanted:
        if isinstance(item, str) and item.startswith("MIG-"):
            out.append(Gpu(NO_INDEX, item))
        elif isinstance(item, str):
            if item not in known:
                raise ValueError(f"--share.gpus: NVML lists no GPU {item}")
            out.append(Gpu(known.index(item), item))
        elif item >= len(known):
            raise ValueError(f"--share.gpus: NVML lists {len(known)} GPUs, no GPU {item}")
        else:
            out.append(Gpu(item, known[item]))
    if len({g.uuid for g in out}) != len(out):
        raise ValueError("--share.gpus names one GPU twice")
    return out
