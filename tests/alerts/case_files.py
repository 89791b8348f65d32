"""Writing the promtool test files that the case generators in this folder render.

Each generator (``memory_shapes``, ``target_cases``, ``engine_cases``, ``dcgm_memory_cases``,
``deployed_gpu_cases``) has ``outputs()`` (repository path → file text) and a ``main()`` that writes
them here; its test compares ``outputs()`` with the committed files.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write(outputs: dict[str, str]) -> int:
    """Write each file that differs from its rendering, naming it on stderr; 0 for a main()."""
    for rel, text in outputs.items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {rel}", file=sys.stderr)
    return 0
