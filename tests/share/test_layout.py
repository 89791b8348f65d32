"""The ledger's layout is written twice, in _ledger.h (the preload library's structs) and in ledger.py
(the controller's offsets): a C program built from the header prints every offset, size and constant,
and each must be the one ledger.py uses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpuscope.share import ledger, preload

HEADER = Path(ledger.__file__).with_name("_ledger.h")

#: ledger.py's name -> the C expression it mirrors
POLICY = {
    "P_MAGIC": "offsetof(policy_t, magic)", "P_VERSION": "offsetof(policy_t, version)",
    "P_PID": "offsetof(policy_t, controller_pid)", "P_NTENANTS": "offsetof(policy_t, ntenants)",
    "P_HEARTBEAT": "offsetof(policy_t, heartbeat_ns)", "P_GATE": "offsetof(policy_t, gate)",
    "P_MODE": "offsetof(policy_t, mode)", "P_WINDOW_US": "offsetof(policy_t, window_us)",
    "P_INFLIGHT_SLICE": "offsetof(policy_t, inflight_slice)",
    "P_INFLIGHT_OPEN": "offsetof(policy_t, inflight_open)", "P_STALE_MS": "offsetof(policy_t, stale_ms)",
    "P_BUSY_MASK": "offsetof(policy_t, busy_mask)", "P_BESIDE_MASK": "offsetof(policy_t, beside_mask)",
    "P_SLICE_END": "offsetof(policy_t, slice_end_ns)", "P_LENDER_MASK": "offsetof(policy_t, lender_mask)",
    "P_BESIDE_QUEUE_US": "offsetof(policy_t, beside_queue_us)",
    "P_TURNS_MASK": "offsetof(policy_t, turns_mask)",
    "P_HOLD_MASK": "offsetof(policy_t, hold_mask)", "P_PRIORITY_HOLD": "offsetof(policy_t, priority_hold)",
    "P_TENANTS": "offsetof(policy_t, tenants)", "TENANT_SIZE": "sizeof(((policy_t *)0)->tenants[0])",
    "T_SHARE": "offsetof(policy_t, tenants[0].share_ppm) - offsetof(policy_t, tenants)",
    "T_PRIORITY": "offsetof(policy_t, tenants[0].priority) - offsetof(policy_t, tenants)",
    "T_ACTIVE": "offsetof(policy_t, tenants[0].active) - offsetof(policy_t, tenants)",
    "T_DUTY": "offsetof(policy_t, tenants[0].duty_ppm) - offsetof(policy_t, tenants)",
    "T_MEM_CAP": "offsetof(policy_t, tenants[0].mem_cap) - offsetof(policy_t, tenants)",
    "MAX_TENANTS": "MAX_TENANTS", "NAME_LEN": "NAME_LEN", "LAYOUT_VERSION": "LAYOUT_VERSION",
    "POLICY_MAGIC": "POLICY_MAGIC", "PROC_MAGIC": "PROC_MAGIC", "TENANT_MAGIC": "TENANT_MAGIC",
    "MEM_CAP_FRACTION": "MEM_CAP_FRACTION", "DEFAULT_WINDOW_US": "DEFAULT_WINDOW_US",
    "DEFAULT_QUEUED_WINDOWS": "DEFAULT_QUEUED_WINDOWS", "DEFAULT_INFLIGHT_OPEN": "DEFAULT_INFLIGHT_OPEN",
    "DEFAULT_STALE_MS": "DEFAULT_STALE_MS", "DEFAULT_BESIDE_QUEUE_US": "DEFAULT_BESIDE_QUEUE_US",
}
PROC = {
    "Q_MAGIC": "offsetof(proc_t, magic)", "Q_VERSION": "offsetof(proc_t, version)",
    "Q_PID": "offsetof(proc_t, pid)", "Q_SLOT": "offsetof(proc_t, slot)",
    "Q_TENANT": "offsetof(proc_t, tenant)",
    "Q_WAITING": "offsetof(proc_t, waiting)", "Q_DRAINED": "offsetof(proc_t, drained_gen)",
    "Q_COUNTERS": "offsetof(proc_t, launches)",
}
MEMORY = {
    "M_MAGIC": "offsetof(tenant_mem_t, magic)", "M_VERSION": "offsetof(tenant_mem_t, version)",
    "M_USED": "offsetof(tenant_mem_t, used)", "M_REFUSED": "offsetof(tenant_mem_t, refused)",
    "M_PEAK": "offsetof(tenant_mem_t, peak)", "M_CARD": "offsetof(tenant_mem_t, card_bytes)",
}
#: the process page's counters, in ledger.PROC_COUNTERS order, as the C struct names them
COUNTERS = ("launches", "graph_launches", "hook_errors", "throttled_ns", "gpu_ns", "windows",
            "last_launch_ns", "inflight", "failed_open", "started_ns", "waits", "window_open",
            "busy_launches", "busy_ns", "mem_bytes", "mem_refused", "sync_wait_ns", "sync_open",
            "sync_open_since_ns", "helper_wakes_probe", "helper_wakes_lock", "helper_wakes_window",
            "helper_wakes_drain", "helper_wakes_nap", "helper_wakes_nap_timeout", "helper_wakes_watch",
            "helper_wakes_watch_timeout", "helper_wakes_gate", "helper_wakes_gate_timeout", "helper_cpu_ns",
            "burst_ns")


@pytest.fixture(scope="module")
def c_values(tmp_path_factory) -> dict[str, int | str]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to read the header's layout")
    exprs = {**POLICY, **PROC, **MEMORY, **{f"counter:{c}": f"offsetof(proc_t, {c})" for c in COUNTERS},
             "policy_size": "sizeof(policy_t)"}
    printed = [f'    printf("%s %llu\\n", "{name}", (unsigned long long)({expr}));'
               for name, expr in exprs.items()]
    printed.append('    printf("DEFAULT_LEDGER %s\\n", DEFAULT_LEDGER);')
    lines = "\n".join(printed)
    d = tmp_path_factory.mktemp("layout")
    (d / "layout.c").write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{HEADER}"\n'
                                f"int main(void) {{\n{lines}\n    return 0;\n}}\n")
    subprocess.run(["gcc", "-o", str(d / "layout"), str(d / "layout.c")], check=True)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return {name: int(value) if value.isdigit() else value
            for name, value in (line.split() for line in out.splitlines())}


@pytest.mark.parametrize("name", [*POLICY, *PROC, *MEMORY])
def test_every_offset_and_constant_of_ledger_py_is_the_headers(c_values, name):
    assert getattr(ledger, name) == c_values[name]


def test_the_default_ledger_path_is_the_headers(c_values):
    assert c_values["DEFAULT_LEDGER"] == preload.DEFAULT_LEDGER


def test_the_process_counters_lie_where_the_header_puts_them(c_values):
    assert ledger.PROC_COUNTERS == COUNTERS
    for i, name in enumerate(COUNTERS):
        assert ledger.Q_COUNTERS + 8 * i == c_values[f"counter:{name}"], name


def test_the_policy_page_fits_one_page(c_values):
    assert c_values["policy_size"] <= 4096
