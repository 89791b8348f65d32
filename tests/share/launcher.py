"""A tenant program for the preload library's tests: launches through the fake libcuda the ways real
programs do (dlsym on a dlopen handle, cuGetProcAddress v1 and v2, per-thread default stream
variants, cuLaunchKernelEx, graph launches), then prints one JSON line: what it launched, the
addresses it was handed, and the preload library's counters (null without the library).

argv: N (launches per path), then optionally "wait-gpu-ns" to wait (with a deadline) until the
accounting posted every window's GPU time before printing."""

import ctypes
import json
import sys
import time

n = int(sys.argv[1])
wait_gpu = len(sys.argv) > 2 and sys.argv[2] == "wait-gpu-ns"
cuda = ctypes.CDLL("libcuda.so.1")
U = ctypes.c_uint
P = ctypes.c_void_p
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, P, U, U, U, U, U, U, U, P, P, P)


class Config(ctypes.Structure):
    _fields_ = [("gx", U), ("gy", U), ("gz", U), ("bx", U), ("by", U), ("bz", U), ("shm", U),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("nattrs", U)]


LAUNCH_EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Config), P, P, P)
GRAPH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def gpa(name: str, flags: int, v2: bool) -> int:
    out = ctypes.c_void_p()
    if v2:
        status = ctypes.c_int(-1)
        rc = cuda.cuGetProcAddress_v2(name.encode(), ctypes.byref(out), 12000, ctypes.c_uint64(flags),
                                      ctypes.byref(status))
    else:
        rc = cuda.cuGetProcAddress(name.encode(), ctypes.byref(out), 12000, ctypes.c_uint64(flags))
    assert rc == 0, (name, rc)
    return out.value


paths = {
    "dlsym": ctypes.cast(cuda.cuLaunchKernel, ctypes.c_void_p).value,
    "dlsym_ptsz": ctypes.cast(cuda.cuLaunchKernel_ptsz, ctypes.c_void_p).value,
    "gpa_v1": gpa("cuLaunchKernel", 0, False),
    "gpa_v2": gpa("cuLaunchKernel", 0, True),
    "gpa_v2_ptsz": gpa("cuLaunchKernel", 2, True),
}
launched = []  # (stream, seq) in call order
seq = 0
for _ in range(n):
    for addr in paths.values():
        stream = 1 + (seq % 3)
        rc = LAUNCH(addr)(None, seq, 1, 1, 5, 1, 1, 0, stream, None, None)  # blockDimX 5: 5 µs fake GPU time
        assert rc == 0
        launched.append([stream, seq])
        seq += 1
    ex = LAUNCH_EX(gpa("cuLaunchKernelEx", 0, True))
    cfg = Config(seq, 1, 1, 5, 1, 1, 0, 1 + (seq % 3), None, 0)
    assert ex(ctypes.byref(cfg), None, None, None) == 0
    launched.append([1 + (seq % 3), seq])
    seq += 1
    graph = GRAPH(gpa("cuGraphLaunch", 0, True))
    assert graph(seq, 1 + (seq % 3)) == 0  # 100 µs fake GPU time
    launched.append([1 + (seq % 3), seq])
    seq += 1

stats = None
own = ctypes.CDLL(None)
if hasattr(own, "gpuscope_share_stats"):
    out = (ctypes.c_uint64 * 8)()
    expected_ns = n * (6 * 5_000 + 100_000)
    deadline = time.monotonic() + 5
    while True:
        own.gpuscope_share_stats(out)
        if not wait_gpu or out[4] >= expected_ns * 0.99 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    stats = dict(zip(["launches", "graph_launches", "hook_errors", "throttled_ns", "gpu_ns", "windows",
                      "failed_open", "joined"], list(out), strict=True))
    hooks = {"cuLaunchKernel": ctypes.cast(own.cuLaunchKernel, ctypes.c_void_p).value,
             "cuLaunchKernel_ptsz": ctypes.cast(own.cuLaunchKernel_ptsz, ctypes.c_void_p).value}
else:
    hooks = None
print(json.dumps({"launched": launched, "paths": paths, "hooks": hooks, "stats": stats}))
