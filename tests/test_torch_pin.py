"""README's no-Docker path and scripts/test.sh install the same torch: one exact pin, its CPU build."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_readme_and_test_script_pin_the_same_cpu_torch():
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / "scripts" / "test.sh").read_text()
    shown = re.findall(r"pip install (torch==[\d.]+) --index-url (\S+)", readme)
    assert shown, "README gives no exact torch install command"
    pinned = re.search(r"^TORCH=(torch==[\d.]+)$", script, re.MULTILINE)
    index = re.search(r"^TORCH_CPU_INDEX=(\S+)$", script, re.MULTILINE)
    assert pinned and index
    assert set(shown) == {(pinned.group(1), index.group(1))} == {(pinned.group(1), CPU_INDEX)}


def test_readme_installs_torch_before_the_package():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**Without Docker**"):readme.index("## Test command")]
    assert section.index("pip install torch==") < section.index('pip install -e ".[server]"')
