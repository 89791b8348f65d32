"""Memory caps with PyTorch on a real GPU (gpu-marked: skipped where there is none)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpuscope.share.ledger import TenantPolicy
from gpuscope.share.preload import tenant_env
from tests.share.fakecuda import running_controller

pytestmark = pytest.mark.gpu
GiB = 2**30

FILL = """
import json, torch
held, error = [], None
try:
    for _ in range(64):
        held.append(torch.empty(2**30, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError as exc:
    error = type(exc).__name__
free, total = torch.cuda.mem_get_info()
print(json.dumps({"held": len(held), "error": error, "free": free, "total": total}))
"""


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_pytorch_raises_its_out_of_memory_error_at_the_tenants_cap(tmp_path, alloc_conf):
    with running_controller(str(tmp_path / "ledger"), [TenantPolicy("a", 1.0, 0, 3 * GiB)]) as c:
        env = tenant_env("a", c.policy.prefix)
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        run = subprocess.run([sys.executable, "-c", FILL], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        seen = json.loads(run.stdout.splitlines()[-1])
        assert seen["error"] == "OutOfMemoryError"
        assert 1 <= seen["held"] <= 3  # the context's own memory is not counted; the tensors are
        assert seen["total"] == 3 * GiB
        assert c.policy.memory[0].refused >= 1
