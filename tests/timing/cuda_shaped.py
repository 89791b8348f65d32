"""A route shaped like CUDA's runtime for the C extension's tests: integer events and the CUDA
functions the C code calls by address (cudaEventRecord, cudaEventQuery, cudaEventElapsedTime,
cudaGetLastError, cudaSetDevice, cudaThreadExchangeStreamCaptureMode), here ctypes callbacks.

The C code calls them as it calls CUDA: the resolver's loop with the GIL released, the recycler from
a thread of its own (ctypes takes the GIL for each callback)."""

from __future__ import annotations

import ctypes
import math

from gpuscope.timing.routes import HostRoute

RECORD_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
QUERY_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
ELAPSED_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)
LAST_ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_int)
SET_DEVICE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
CAPTURE_MODE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_INVALID_RESOURCE_HANDLE = 400
CUDA_ERROR_INVALID_DEVICE = 101
STEP_MS = 0.25  # every record advances the scripted GPU clock by 250 µs


class CudaShapedRoute(HostRoute):
    """The clock advances ``STEP_MS`` per record, so every region of back-to-back records lasts
    exactly that long. An event is finished once the GPU has reached its stamp (``gpu_ms``,
    unbounded by default) and it is not in ``not_ready``. Events belong to the device current
    when they were made; ``device`` is the program's current device (``use_device`` sets it)."""

    name = "cuda-shaped"

    def __init__(self) -> None:
        self.stamps: dict[int, float] = {}
        self.event_device: dict[int, int] = {}
        self.destroyed: set[int] = set()
        self.clock_ms = 0.0
        self.gpu_ms = math.inf
        self.not_ready: set[int] = set()
        self.elapsed_fails = False
        self.elapsed_nan = False  # a driver answering NaN: no resolver may count it
        self.record_fails = False
        self.queries = self.elapsed_calls = self.cleared = 0
        self.device = 0
        #: CUDA calls made off the calling thread's Python code: ("set_device", n), ("capture_mode", mode),
        #: ("query", device the event belongs to, device current on the calling CUDA thread)
        self.calls: list[tuple] = []
        self._cuda_thread_device = -1
        self._next = 1000

        def record(event, stream):
            if self.record_fails:
                return CUDA_ERROR_INVALID_RESOURCE_HANDLE
            self.clock_ms += STEP_MS
            self.stamps[event] = self.clock_ms
            return 0

        def query(event):
            self.queries += 1
            self.calls.append(("query", self.event_device.get(event), self._cuda_thread_device))
            assert event not in self.destroyed, "an event was asked about after it was destroyed"
            if event in self.not_ready or self.stamps.get(event, 0.0) > self.gpu_ms:
                return CUDA_ERROR_NOT_READY
            return 0

        def elapsed(ms, start, end):
            self.elapsed_calls += 1
            if self.elapsed_fails:
                return CUDA_ERROR_INVALID_RESOURCE_HANDLE
            ms[0] = math.nan if self.elapsed_nan else self.stamps[end] - self.stamps[start]
            return 0

        def clear():
            self.cleared += 1
            return 0

        def set_device(device):
            self.calls.append(("set_device", device))
            self._cuda_thread_device = device
            return 0

        def capture_mode(mode):
            self.calls.append(("capture_mode", mode[0]))
            return 0

        # Kept alive as long as the route: the C code calls them by address.
        self._fns = (RECORD_FN(record), QUERY_FN(query), ELAPSED_FN(elapsed), LAST_ERROR_FN(clear),
                     SET_DEVICE_FN(set_device), CAPTURE_MODE_FN(capture_mode))
        (self.record_address, self.query_address, self.elapsed_address, self.clear_error_address,
         self.set_device_address, self.capture_mode_address) = (
            ctypes.cast(fn, ctypes.c_void_p).value for fn in self._fns)

    def current_device(self) -> int:
        return self.device

    def use_device(self, device: int) -> int:
        previous, self.device = self.device, device
        return previous

    def create(self) -> int:
        self._next += 1
        self.event_device[self._next] = self.device
        return self._next

    def destroy(self, event: int) -> None:
        self.destroyed.add(event)

    def record(self, event: int, stream: int) -> int:
        return self._fns[0](event, stream)

    def query(self, event: int) -> bool:
        return self._fns[1](event) == 0

    def elapsed_s(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        if self._fns[2](ctypes.byref(ms), start, end):
            raise RuntimeError("cudaEventElapsedTime failed")
        return ms.value * 1e-3
