"""The NVML boundary: which module answers NVML calls, and how its errors are classified.

The exporter calls NVML only through an object with pynvml's function names, return shapes
and exceptions: the real ``pynvml`` module in production, a fake in tests. Both raise
``pynvml.NVMLError`` subclasses with NVML's error codes, so the same code runs on both paths.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

#: NVML answers that mean "this device will never answer this call": stop asking it.
UNSUPPORTED_CODES = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
NVMLError = pynvml.NVMLError

# NVML's "no such value" sentinels (unsigned -1) for MIG ids and per-process memory.
INVALID_ID = 0xFFFFFFFF


def real_nvml() -> Any:
    """The real NVML binding (``pynvml``); initialising it is the caller's job."""
    return pynvml


def error_code(exc: BaseException) -> int:
    """NVML error code of an exception (999, NVML's UNKNOWN, for anything else)."""
    return int(getattr(exc, "value", pynvml.NVML_ERROR_UNKNOWN))


def error_text(exc: BaseException) -> str:
    """Readable NVML error, never raising (pynvml's ``__str__`` may call into the library)."""
    try:
        return str(exc)
    except Exception:
        return f"NVML error {error_code(exc)}"


def handle_key(handle: Any) -> int:
    """A hashable identity for a device handle.

    Real handles are ctypes pointers; NVML returns fresh pointer objects for the same device
    (for example in XID event data), so identity is the address they point to.
    """
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def text(value: Any) -> str:
    """NVML strings arrive as ``str`` (decorated calls) or ``bytes`` (struct fields such as busId)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)
