"""gpuscope's locustfile: one streaming user class per tenant, and the stage-table shape.

``loadtest/locustfile.py`` re-exports this module, so ``locust -f loadtest/``
and the comparison command (which points Locust at this file directly, wherever
the package is installed) run the same definitions.

Tenants come from ``GPUSCOPE_LOAD_TENANTS`` (``name:weight,...``) because Locust
needs the user classes before it parses options.
"""

from __future__ import annotations

from locust import LoadTestShape

import gpuscope.loadtest.plugin  # noqa: F401  (registers gpuscope's options and recorder)
from gpuscope.loadtest.options import tenants_from_env
from gpuscope.loadtest.shapes import stage_at
from gpuscope.loadtest.users import tenant_users


class GpuscopeShape(LoadTestShape):
    """Stage-table load shape: ``--shape`` picks the table, ``-u`` is the peak, ``-t`` the length.

    Locust uses a shape only when one is chosen (headless, or in the web UI's
    shape picker); with ``--shape steady`` it behaves as plain ``-u``/``-r``/``-t``.
    """

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options if self.runner else None
        return stage_at(
            getattr(options, "shape", None) or "steady",
            self.get_run_time(),
            getattr(options, "run_time", None) or None,
            int(getattr(options, "num_users", None) or 1),
            float(getattr(options, "spawn_rate", None) or 1.0),
        )


_TENANT_CLASSES = tenant_users(tenants_from_env(), __name__)
globals().update(_TENANT_CLASSES)

__all__ = ["GpuscopeShape", *_TENANT_CLASSES]
