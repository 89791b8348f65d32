"""Where the preload library is, and the environment a tenant process needs to load it."""

from __future__ import annotations

import glob
import os

DEFAULT_LEDGER = "/dev/shm/gpuscope-share"  # _ledger.h has the same (tests/share/test_layout.py)


def library_path() -> str | None:
    """The built ``_preload`` shared library next to this module, or None where it was not built."""
    here = os.path.dirname(__file__)
    found = sorted(glob.glob(os.path.join(here, "_preload*.so")))
    return found[0] if found else None


def tenant_env(tenant: str, ledger: str = DEFAULT_LEDGER,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) plus what joins ``tenant`` under the controller
    whose ledger is ``ledger``."""
    lib = library_path()
    if lib is None:
        raise FileNotFoundError("the gpuscope share preload library is not built (it needs a C compiler)")
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = f"{lib} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
    env["GPUSCOPE_SHARE_TENANT"] = tenant
    env["GPUSCOPE_SHARE_LEDGER"] = ledger
    return env


if __name__ == "__main__":  # `python -m gpuscope.share.preload` prints the path, for LD_PRELOAD=$(...)
    import sys

    path = library_path()
    if path is None:
        sys.stderr.write("gpuscope share: the preload library is not built\n")
        raise SystemExit(1)
    print(path)
