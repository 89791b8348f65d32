"""Dashboard queries allowed to return no data in the end-to-end test, and why. Reviewed; keep it short.

Keyed by (dashboard uid, panel title, refId). The end-to-end test fails when a query
returns no data and is not listed here, AND when a query in ALLOWED_EMPTY does return data
(the entry is stale: remove it), so this list cannot hide a broken panel for long.
"""

from __future__ import annotations

NO_GPU = ("NVML series: CI and laptops have no GPU (and no NVML library), so the exporter serves only its "
          "device count and NVML errors")

ALLOWED_EMPTY: dict[tuple[str, str, str], str] = {
    **{("gpuscope-fleet", title, ref): NO_GPU for title, ref in [
        ("GPUs answering", "A"), ("Mean utilization", "A"), ("Power draw", "A"), ("Power", "C"),
        ("Utilization across GPUs", "A"), ("GPU utilization", "A"), ("Memory bandwidth utilization", "A"),
        ("Framebuffer memory used", "A"), ("Framebuffer memory used", "B"), ("Temperature", "A"),
        ("Temperature", "B"), ("Power", "A"), ("Power", "B"), ("Clocks", "A"), ("Clocks", "B"),
        ("Throttle reasons (share of time)", "A"), ("Performance state", "A"), ("Recent XIDs per GPU", "A"),
        ("ECC errors and PCIe replays", "A"), ("ECC errors and PCIe replays", "B"),
        ("Oldest cached value", "A"), ("Exporter sampling cost", "A"),
    ]},
    **{("gpuscope-bottlenecks", title, ref): NO_GPU for title, ref in [
        ("GPU busy", "A"), ("GPU memory used", "A"), ("CPU against GPU utilization", "B"),
        ("Memory: host, GPU framebuffer, server", "B"), ("Queue depth against GPU utilization", "B"),
    ]},
}

KERNEL_BUSY = ("kernel busy windows need a GPU and cupti-python (gpuscope serve --timing.kernel-busy, off by "
               "default); the kernel busy GPU test checks the ratio itself")
ENERGY = "energy per token needs the GPUs' energy counter (NVML or DCGM): " + NO_GPU
SHARE_NO_NVML = ("gpuscope share without NVML (no GPU here) cannot list the GPU's processes or read their "
                 "utilization: the unmanaged-process series and NVML's view of tenant GPU time are absent; "
                 "the alert cases (tests/alerts/cases/sources/gpuscope-share.test.yml) drive them")
ALLOWED_EMPTY.update({
    **{("gpuscope-tenants", title, ref): ENERGY
       for title in ("Energy per output token", "Cost per million output tokens")
       for ref in ("A", "B")},
    ("gpuscope-tenants", "GPU time: charged against NVML", "B"): SHARE_NO_NVML,
    ("gpuscope-tenants", "Processes outside the share controller", "A"): SHARE_NO_NVML,
    ("gpuscope-tenants", "Memory of processes outside the share controller", "A"): SHARE_NO_NVML,
    ("gpuscope-kernels", "Kernel busy share per op", "A"): KERNEL_BUSY,
    ("gpuscope-bottlenecks", "Launch-bound modules", "A"): KERNEL_BUSY,
})

#: Queries that may or may not have data depending on timing; neither outcome fails the test.
MAY_BE_EMPTY: dict[tuple[str, str, str], str] = {
    ("gpuscope-logs", "Firing alerts", "A"): (
        "ALERTS{alertstate=\"firing\"} has data only while an alert fires: a healthy stack fires none "
        "(unless a health rule's `for` elapses on a slow machine); the alert live tests drive firing ones"),
}

#: Variables whose values come only from a GPU.
ALLOWED_EMPTY_VARIABLES: dict[str, str] = {"gpu": NO_GPU}
