"""The GPUs one ``gpuscope share`` controller holds (``--share.gpus``): every GPU of the node, or some.

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


@dataclass(frozen=True)
class Gpu:
    """One GPU the controller holds: its NVML index and UUID (``""``: unknown, no NVML)."""

    index: int
    uuid: str = ""

    @property
    def uuid_bytes(self) -> bytes:
        return parse_uuid(self.uuid) if self.uuid else b""

    @property
    def label(self) -> str:
        """The ``gpu`` label of its metrics."""
        return str(self.index)


def parse_gpus(text: str) -> str | tuple[int, ...]:
    """``all``, or NVML indices ``0,1,...`` (each once)."""
    text = str(text).strip()
    if text == ALL:
        return ALL
    try:
        indices = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--share.gpus takes 'all' or NVML indices such as 0,1, not {text!r}") from None
    if not indices or any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"--share.gpus takes 'all' or NVML indices such as 0,1 (each once), not {text!r}")
    return indices


def nvml_uuids() -> list[str]:
    """The node's GPUs' UUIDs, by NVML index."""
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    return out


def select(wanted: str | tuple[int, ...], uuids: Callable[[], list[str]] = nvml_uuids,
           log: Callable[[str], None] | None = None) -> list[Gpu]:
    """The GPUs ``--share.gpus`` names. Without NVML: one GPU of unknown UUID (the first index asked
    for), which takes every tenant process. ValueError for an index NVML does not list."""
    try:
        known = uuids()
    except Exception as exc:  # no NVML: one GPU, as before there were several
        first = 0 if wanted == ALL else wanted[0]
        if log is not None:
            log(f"gpuscope share: NVML cannot list the GPUs ({exc}): holding one GPU, whichever each tenant "
                "process uses")
        return [Gpu(first)]
    if wanted == ALL:
        if not known:
            raise ValueError("NVML lists no GPU")
        return [Gpu(i, u) for i, u in enumerate(known)]
    missing = [i for i in wanted if i >= len(known)]
    if missing:
        raise ValueError(f"--share.gpus: NVML lists {len(known)} GPUs, no GPU {missing[0]}")
    return [Gpu(i, known[i]) for i in wanted]
