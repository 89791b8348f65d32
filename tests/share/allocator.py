"""A tenant program for the memory-cap tests: allocates and frees device memory through the fake
libcuda the ways real programs do, one command per line on stdin, one JSON answer per line on stdout.

Commands (JSON lists):
- ["alloc", ROUTE, BYTES, COUNT]: COUNT allocations; ROUTE is symbol (cuMemAlloc_v2 by name), gpa
  (cuGetProcAddress "cuMemAlloc"), pitch, managed, async, async_ptsz (cuGetProcAddress with the
  per-thread flag), pool, create (cuMemCreate). Answers the return codes.
- ["free", N]: frees the N oldest allocations (each through its route's free); answers the codes.
- ["info"]: cuMemGetInfo through cuGetProcAddress, and NVML's v1 and v2 memory info.
- ["device", D]: makes device D's context current (as cudaSetDevice does); answers 0.
- ["launch", N]: N kernels of 5 µs on the current device; answers the return codes (a held launch
  answers once its gate opens).
- ["exit"].
"""

import ctypes
import json
import sys

cuda = ctypes.CDLL("libcuda.so.1")
U64 = ctypes.c_uint64
SIZE = ctypes.c_size_t
P = ctypes.c_void_p
PTSZ = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM


def gpa(name: str, flags: int = 0) -> int:
    out = ctypes.c_void_p()
    assert cuda.cuGetProcAddress(name.encode(), ctypes.byref(out), 12000, ctypes.c_uint64(flags)) == 0, name
    return out.value


ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(U64), SIZE)
ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(U64), SIZE, P)
FREE = ctypes.CFUNCTYPE(ctypes.c_int, U64)
FREE_ASYNC = ctypes.CFUNCTYPE(ctypes.c_int, U64, P)
INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(SIZE), ctypes.POINTER(SIZE))

alloc_gpa = ALLOC(gpa("cuMemAlloc"))
async_ptsz = ASYNC(gpa("cuMemAllocAsync", PTSZ))
free_async_ptsz = FREE_ASYNC(gpa("cuMemFreeAsync", PTSZ))
info = INFO(gpa("cuMemGetInfo"))
held: list[tuple[str, int]] = []


def allocate(route: str, n: int) -> int:
    out = U64()
    if route == "symbol":
        rc = cuda.cuMemAlloc_v2(ctypes.byref(out), SIZE(n))
    elif route == "gpa":
        rc = alloc_gpa(ctypes.byref(out), n)
    elif route == "pitch":
        pitch = SIZE()
        rc = cuda.cuMemAllocPitch_v2(ctypes.byref(out), ctypes.byref(pitch), SIZE(n // 64), SIZE(64),
                                     ctypes.c_uint(4))
    elif route == "managed":
        rc = cuda.cuMemAllocManaged(ctypes.byref(out), SIZE(n), ctypes.c_uint(1))
    elif route == "async":
        rc = cuda.cuMemAllocAsync(ctypes.byref(out), SIZE(n), P(0))
    elif route == "async_ptsz":
        rc = async_ptsz(ctypes.byref(out), n, None)
    elif route == "pool":
        rc = cuda.cuMemAllocFromPoolAsync(ctypes.byref(out), SIZE(n), P(1), P(0))
    elif route == "create":
        rc = cuda.cuMemCreate(ctypes.byref(out), SIZE(n), P(0), ctypes.c_ulonglong(0))
    else:
        raise ValueError(route)
    if rc == 0:
        held.append((route, out.value))
    return rc


def release(route: str, key: int) -> int:
    if route == "create":
        return cuda.cuMemRelease(U64(key))
    if route == "async":
        return cuda.cuMemFreeAsync(U64(key), P(0))
    if route == "async_ptsz":
        return free_async_ptsz(key, None)
    return cuda.cuMemFree_v2(U64(key))


def memory_info() -> dict:
    free_b, total = SIZE(), SIZE()
    assert info(ctypes.byref(free_b), ctypes.byref(total)) == 0
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    device = ctypes.c_void_p()
    assert nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) == 0
    v1 = (ctypes.c_ulonglong * 3)()
    v2 = (ctypes.c_ulonglong * 5)()  # version (with padding), total, reserved, free, used
    assert nvml.nvmlDeviceGetMemoryInfo(device, v1) == 0
    assert nvml.nvmlDeviceGetMemoryInfo_v2(device, v2) == 0
    return {"cuda": {"free": free_b.value, "total": total.value},
            "nvml": {"total": v1[0], "free": v1[1], "used": v1[2]},
            "nvml_v2": {"total": v2[1], "reserved": v2[2], "free": v2[3], "used": v2[4]}}


for line in sys.stdin:
    command = json.loads(line)
    if command[0] == "alloc":
        _, route, n, count = command
        answer = [allocate(route, n) for _ in range(count)]
    elif command[0] == "free":
        taken, held[:] = held[:command[1]], held[command[1]:]
        answer = [release(route, key) for route, key in taken]
    elif command[0] == "info":
        answer = memory_info()
    elif command[0] == "device":
        ctx = ctypes.c_void_p()
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ctypes.c_int(command[1])) == 0
        answer = cuda.cuCtxSetCurrent(ctx)
    elif command[0] == "launch":
        one, five = ctypes.c_uint(1), ctypes.c_uint(5)
        answer = [cuda.cuLaunchKernel(None, ctypes.c_uint(i), one, one, five, one, one, ctypes.c_uint(0),
                                      P(1), None, None) for i in range(command[1])]
    else:
        break
    print(json.dumps(answer), flush=True)
