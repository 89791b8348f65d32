"""Ways to create, record, query and time events: the only code that talks to CUDA.

Each route offers the same operations on opaque event handles. The timer picks
the cheapest route that works (``pick_route``):

=================  ==========================================================
``cudart-ctypes``  ``cudaEventRecord`` through ctypes on the libcudart torch
                   already loaded: the cheapest record measured (docs/design.md,
                   "CPU cost of one call"). Records go through ``PyDLL`` so the call
                   keeps the GIL: releasing and re-taking it costs more than
                   the record and invites the resolver thread in mid-forward.
``cuda-bindings``  NVIDIA's ``cuda.bindings.runtime``: a little dearer a record.
``torch``          ``torch.cuda.Event``: several times dearer a record; the fallback.
``host``           ``perf_counter_ns`` stamps for CPU-only machines, where torch
                   runs ops synchronously so wall time is the op's time.
=================  ==========================================================

Events belong to the device that was current when they were created, and the
current device is per thread (a new thread starts on device 0, and PyTorch may
leave the runtime's current device different from ``torch.cuda.current_device()``).
So every call off the hot path runs under ``on_device(route, device)``, which
makes the events' device current for the calling thread and restores it after;
the hot path records on the current device's pool and stream, which match by
construction. A failed call clears the thread's last-error slot before it
returns or raises: CUDA keeps the last error per thread, and torch checks it
after its next kernel launch, so a timer failure left there would surface as an
exception in the caller's own code.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import time
from typing import Any, Protocol

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_EVENT_RECORD_EXTERNAL = 1
CUDA_STREAM_CAPTURE_MODE_RELAXED = 2


class Route(Protocol):
    """The event operations the timer needs; ``record`` is the only one on the hot path."""

    name: str
    on_host: bool  # True when events are host timestamps: samples are labelled device="cpu"
    #: Optional: the address of a C ``int record(void *event, void *stream)`` the C hot path may
    #: call instead of ``record`` (events and streams are then integer handles); 0 or absent: none.
    record_address: int
    gpu_queue: bool  # True when the baseline must be calibrated behind queued GPU work

    def current_device(self) -> int: ...
    def current_stream(self, device: int) -> int: ...
    def is_capturing(self) -> bool: ...

    def use_device(self, device: int) -> int:
        """Make ``device`` current for this thread; return the device that was current."""
        ...

    def has_context(self, device: int) -> bool:
        """Whether ``device`` already has its CUDA context (making it current would create one)."""
        ...

    def create(self) -> Any: ...
    def record(self, event: Any, stream: int) -> int: ...

    def record_external(self, event: Any, stream: int) -> int:
        """Record ``event`` as a node of the graph ``stream`` is capturing (re-recorded on every replay)."""
        ...

    def query(self, event: Any) -> bool: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...
    def destroy(self, event: Any) -> None: ...
    def relax_capture_mode(self) -> None: ...
    def clear_error(self) -> None: ...


@contextlib.contextmanager
def on_device(route: Route, device: int) -> Any:
    """Run the block with ``device`` current on this thread (and the previous one restored after)."""
    previous = route.use_device(device)
    try:
        yield
    finally:
        # A thread's default device is 0 even when it never used it; switching back to a device
        # without a context would create one (hundreds of MiB on a GPU the program does not use).
        if previous != device and route.has_context(previous):
            route.use_device(previous)


class HostRoute:
    """Wall-clock stamps: an "event" is a one-element list holding ``perf_counter_ns``."""

    name = "host"
    on_host = True
    gpu_queue = False

    def current_device(self) -> int:
        return 0

    def current_stream(self, device: int) -> int:
        return 0

    def is_capturing(self) -> bool:
        return False

    def use_device(self, device: int) -> int:
        return 0

    def has_context(self, device: int) -> bool:
        return True

    def create(self) -> list[int]:
        return [0]

    def record(self, event: list[int], stream: int, _now=time.perf_counter_ns) -> int:
        event[0] = _now()
        return 0

    record_external = record

    def query(self, event: list[int]) -> bool:
        return True

    def elapsed_s(self, start: list[int], end: list[int]) -> float:
        return (end[0] - start[0]) * 1e-9

    def destroy(self, event: list[int]) -> None:
        pass

    def relax_capture_mode(self) -> None:
        pass

    def clear_error(self) -> None:
        pass


def _loaded_libcudart() -> str | None:
    """Path of the libcudart this process already mapped (torch's own), else one shipped beside torch."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    import torch

    roots = {os.path.dirname(os.path.dirname(torch.__file__))}
    patterns = ("nvidia/*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*",
                "torch/lib/libcudart*.so*")
    for root in roots:
        for pattern in patterns:
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return found[-1]
    return None


class _TorchCurrent:
    """Device, stream and capture lookups through torch's C bindings (no Python wrapper frames)."""

    on_host = False
    gpu_queue = True

    def _bind_torch(self) -> None:
        import torch

        self.current_device = torch._C._cuda_getDevice
        self.current_stream = torch._C._cuda_getCurrentRawStream
        self.is_capturing = torch._C._cuda_isCurrentStreamCapturing
        self._has_primary_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)

    def has_context(self, device: int) -> bool:
        return self._has_primary_context is None or bool(self._has_primary_context(device))


class CudartCtypesRoute(_TorchCurrent):
    """CUDA runtime through ctypes on torch's own libcudart (same runtime instance as torch)."""

    name = "cudart-ctypes"

    def __init__(self, path: str | None = None) -> None:
        self._bind_torch()
        path = path or _loaded_libcudart()
        if path is None:
            raise OSError("libcudart not found beside torch")
        keep_gil = ctypes.PyDLL(path)
        lib = ctypes.CDLL(path)
        self._lib = lib
        self.record = keep_gil.cudaEventRecord
        self.record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.record.restype = ctypes.c_int
        #: where the C hot path (hot.py) calls cudaEventRecord directly, without ctypes' conversions
        self.record_address = ctypes.cast(self.record, ctypes.c_void_p).value
        self._record_with_flags = keep_gil.cudaEventRecordWithFlags
        self._record_with_flags.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._record_with_flags.restype = ctypes.c_int
        self._query = keep_gil.cudaEventQuery
        self._query.argtypes = [ctypes.c_void_p]
        self._query.restype = ctypes.c_int
        self._elapsed = keep_gil.cudaEventElapsedTime
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self._elapsed.restype = ctypes.c_int
        self._ms = ctypes.c_float()
        self._ms_ref = ctypes.byref(self._ms)
        self._create = lib.cudaEventCreate
        self._create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._destroy = lib.cudaEventDestroy
        self._destroy.argtypes = [ctypes.c_void_p]
        self._exchange_mode = lib.cudaThreadExchangeStreamCaptureMode
        self._exchange_mode.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self._get_device = keep_gil.cudaGetDevice
        self._get_device.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self._set_device = keep_gil.cudaSetDevice
        self._set_device.argtypes = [ctypes.c_int]
        self.clear_error = keep_gil.cudaGetLastError
        #: where the resolver's C loop (Resolve in _hotpath.c) asks CUDA, with the GIL released
        self.query_address = ctypes.cast(self._query, ctypes.c_void_p).value
        self.elapsed_address = ctypes.cast(self._elapsed, ctypes.c_void_p).value
        self.clear_error_address = ctypes.cast(self.clear_error, ctypes.c_void_p).value
        #: what the recycler thread (_hotpath.c) calls to pick its device and relax capture mode
        self.set_device_address = ctypes.cast(self._set_device, ctypes.c_void_p).value
        self.capture_mode_address = ctypes.cast(self._exchange_mode, ctypes.c_void_p).value

    def _check(self, err: int, call: str) -> None:
        if err != CUDA_SUCCESS:
            self.clear_error()
            raise RuntimeError(f"{call} failed with CUDA error {err}")

    def use_device(self, device: int) -> int:
        # The runtime's own current device, not torch's: torch may set it lazily (c10's
        # MaybeSetDevice), and the runtime's is what event calls are checked against.
        current = ctypes.c_int()
        self._check(self._get_device(ctypes.byref(current)), "cudaGetDevice")
        if current.value != device:
            self._check(self._set_device(device), f"cudaSetDevice({device})")
        return current.value

    def create(self) -> int:
        handle = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(handle)), "cudaEventCreate")
        return handle.value

    def record_external(self, event: int, stream: int) -> int:
        return self._record_with_flags(event, stream, CUDA_EVENT_RECORD_EXTERNAL)

    def query(self, event: int) -> bool:
        err = self._query(event)
        if err == CUDA_SUCCESS:
            return True
        if err != CUDA_ERROR_NOT_READY:
            self.clear_error()
        return False

    def elapsed_s(self, start: int, end: int) -> float:
        self._check(self._elapsed(self._ms_ref, start, end), "cudaEventElapsedTime")
        return self._ms.value * 1e-3

    def destroy(self, event: int) -> None:
        if self._destroy(event) != CUDA_SUCCESS:
            self.clear_error()

    def relax_capture_mode(self) -> None:
        # The resolver queries events while an inference thread may be capturing a CUDA graph in
        # "global" mode, which forbids such calls from *any* thread and would invalidate the capture.
        # Relaxed mode exempts this thread (what PyTorch's NCCL watchdog does for the same reason).
        mode = ctypes.c_int(CUDA_STREAM_CAPTURE_MODE_RELAXED)
        self._exchange_mode(ctypes.byref(mode))


class CudaBindingsRoute(_TorchCurrent):
    """CUDA runtime through NVIDIA's ``cuda-bindings`` package."""

    name = "cuda-bindings"

    def __init__(self) -> None:
        from cuda.bindings import runtime

        self._bind_torch()
        self._rt = runtime
        record = runtime.cudaEventRecord
        self.record = lambda event, stream: record(event, stream)[0]
        with_flags = runtime.cudaEventRecordWithFlags
        self.record_external = lambda event, stream: with_flags(event, stream, CUDA_EVENT_RECORD_EXTERNAL)[0]

    def _check(self, err: Any, call: str) -> None:
        if int(err) != CUDA_SUCCESS:
            self.clear_error()
            raise RuntimeError(f"{call} failed: {err}")

    def use_device(self, device: int) -> int:
        err, current = self._rt.cudaGetDevice()
        self._check(err, "cudaGetDevice")
        if current != device:
            self._check(self._rt.cudaSetDevice(device)[0], f"cudaSetDevice({device})")
        return current

    def create(self) -> Any:
        err, event = self._rt.cudaEventCreate()
        self._check(err, "cudaEventCreate")
        return event

    def query(self, event: Any) -> bool:
        err = int(self._rt.cudaEventQuery(event)[0])
        if err not in (CUDA_SUCCESS, CUDA_ERROR_NOT_READY):
            self.clear_error()
        return err == CUDA_SUCCESS

    def elapsed_s(self, start: Any, end: Any) -> float:
        err, ms = self._rt.cudaEventElapsedTime(start, end)
        self._check(err, "cudaEventElapsedTime")
        return ms * 1e-3

    def destroy(self, event: Any) -> None:
        if int(self._rt.cudaEventDestroy(event)[0]) != CUDA_SUCCESS:
            self.clear_error()

    def clear_error(self) -> None:
        self._rt.cudaGetLastError()

    def relax_capture_mode(self) -> None:
        self._rt.cudaThreadExchangeStreamCaptureMode(self._rt.cudaStreamCaptureMode(CUDA_STREAM_CAPTURE_MODE_RELAXED))


class TorchRoute(_TorchCurrent):
    """``torch.cuda.Event``: always available with CUDA torch, several times dearer per record
    (docs/design.md, "Inside a real forward pass")."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self._bind_torch()
        self._torch = torch

    def use_device(self, device: int) -> int:
        # torch's events carry their device and switch to it themselves; only creation needs it.
        current = self._torch.cuda.current_device()
        if current != device:
            self._torch.cuda.set_device(device)
        return current

    def create(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def record(self, event: Any, stream: int) -> int:
        # torch records on the current stream, which is the stream the caller passed.
        event.record()
        return 0

    def record_external(self, event: Any, stream: int) -> int:
        # torch's events are not made for graph nodes here; TimedGraph refuses this route up front.
        return CUDA_ERROR_NOT_SUPPORTED

    def query(self, event: Any) -> bool:
        return event.query()

    def elapsed_s(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e-3

    def destroy(self, event: Any) -> None:
        pass

    def relax_capture_mode(self) -> None:
        pass

    def clear_error(self) -> None:
        pass


ROUTES = {"cudart-ctypes": CudartCtypesRoute, "cuda-bindings": CudaBindingsRoute, "torch": TorchRoute,
          "host": HostRoute}


def pick_route(backend: str) -> Route:
    """The route for ``backend``: "auto", "cuda" (fastest CUDA route), "host", or a route name."""
    if backend in ("host", "torch", "cuda-bindings", "cudart-ctypes"):
        return ROUTES[backend]()
    if backend not in ("auto", "cuda"):
        raise ValueError(f"unknown timing backend {backend!r} (auto, cuda, host, {', '.join(ROUTES)})")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        if backend == "cuda":
            raise RuntimeError("timing backend 'cuda' asked for, but torch sees no CUDA device")
        return HostRoute()
    torch.cuda.init()
    for factory in (CudartCtypesRoute, CudaBindingsRoute):
        try:
            return factory()
        except (ImportError, OSError, AttributeError):
            continue
    return TorchRoute()
