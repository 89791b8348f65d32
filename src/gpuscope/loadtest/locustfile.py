"""gpuscope's locustfile: one streaming user class per tenant, and the stage-table shape.

``loadtest/locustfile.py`` re-exports this module, so ``locust -f loadtest/``
and the comparison command (which points Locust at this file directly, wherever
the package is installed) run the same definitions.

Tenants come from ``GPUSCOPE_LOAD_TENANTS`` (``name:weight,...``) because Locust
needs the user classes before it parses options.
"""

from __future__ import annotations

import logging

from locust import LoadTestShape

import gpuscope.loadtest.plugin  # noqa: F401  (registers gpuscope's options and recorder)
from gpuscope.loadtest.options import tenants_from_env
from gpuscope.loadtest.shapes import SHAPES, stage_at
from gpuscope.loadtest.users import tenant_users


class GpuscopeShape(LoadTestShape):
    """Stage-table load shape: ``--shape`` picks the table, ``-u`` is the peak, ``-t`` the length.

    With ``--shape steady`` (the default) it behaves as plain ``-u``/``-r``/``-t``,
    headless and in the web UI, whose user count, spawn rate and run time it reads.
    """

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options if self.runner else None
        name = getattr(options, "shape", None) or "steady"
        if name not in SHAPES:  # the web UI edits options as plain strings, unchecked
            logging.getLogger("gpuscope.loadtest").error("unknown shape %r; running steady", name)
            options.shape = name = "steady"
        return stage_at(
            name,
            self.get_run_time(),
            getattr(options, "run_time", None) or None,
            int(getattr(options, "num_users", None) or 1),
            float(getattr(options, "spawn_rate", None) or 1.0),
        )


_TENANT_CLASSES = tenant_users(tenants_from_env(), __name__)
globals().update(_TENANT_CLASSES)

__all__ = ["GpuscopeShape", *_TENANT_CLASSES]
