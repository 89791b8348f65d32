"""A tenant program on the fake driver's shared GPU (FAKE_CUDA_REALTIME, FAKE_CUDA_SHARED_GPU): runs
one kind of step for a number of seconds and prints how many steps it finished, as JSON.

argv: KIND SECONDS
- ``steps``: a training-like step, ``BURST`` kernels of ``KERNEL_US`` each, a stream synchronize,
  then ``GAP_MS`` of host work: the GPU idles during the gap unless another tenant fills it.
- ``busy``: kernels of ``KERNEL_US`` back to back, in batches of ``BURST``; before queueing a batch
  it waits for the one before the last (a GPU-bound loop that keeps the GPU fed with a bounded
  queue, as a framework's launch queue and syncs bound a real one). A step is one kernel.
- ``replay``: a graph launch (FAKE_CUDA_GRAPH_US of GPU time) and a context synchronize, again at
  once: a captured CUDA graph replayed and waited for every step, few long launches.
Sizes come from the environment (WORKLOAD_BURST, WORKLOAD_KERNEL_US, WORKLOAD_GAP_MS)."""

import ctypes
import json
import os
import sys
import time

kind, seconds = sys.argv[1], float(sys.argv[2])
burst = int(os.environ.get("WORKLOAD_BURST", "10"))
kernel_us = int(os.environ.get("WORKLOAD_KERNEL_US", "300"))
gap_s = float(os.environ.get("WORKLOAD_GAP_MS", "3")) / 1000
cuda = ctypes.CDLL("libcuda.so.1")
U = ctypes.c_uint
events = [ctypes.c_void_p(), ctypes.c_void_p()]
for e in events:
    assert cuda.cuEventCreate(ctypes.byref(e), U(0)) == 0


def launch(n: int) -> None:
    assert cuda.cuLaunchKernel(None, U(n), U(1), U(1), U(kernel_us), U(1), U(1), U(0), ctypes.c_void_p(1),
                               None, None) == 0


steps = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    if kind == "steps":
        for i in range(burst):
            launch(i)
        cuda.cuStreamSynchronize(ctypes.c_void_p(1))  # as loss.item() waits for the step
        time.sleep(gap_s)
        steps += 1
    elif kind == "replay":
        assert cuda.cuGraphLaunch(ctypes.c_void_p(1), ctypes.c_void_p(1)) == 0
        cuda.cuCtxSynchronize()
        steps += 1
    else:
        batch = steps // burst
        cuda.cuEventSynchronize(events[batch % 2])  # the batch before the last has finished
        for i in range(burst):
            launch(i)
        cuda.cuEventRecord(events[batch % 2], ctypes.c_void_p(1))
        steps += burst
print(json.dumps({"kind": kind, "steps": steps}))
