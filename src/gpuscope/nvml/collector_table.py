"""Every collector of the exporter: the registry's table once each module that defines one is imported.

A collector registers itself where it is defined (``registry.register_collector``), so the table is
only complete after those modules are imported; this module imports them, and the flags
(``config``) and the exporter's assembly (``exporter``) read the table here. The registry itself
imports no collector, so the modules that register into it do not import each other in a circle.
"""

from __future__ import annotations

from gpuscope.nvml import collectors, xid
from gpuscope.nvml.registry import Registration, registrations

#: The modules whose import registers collectors.
DEFINING_MODULES = (collectors, xid)


def registered() -> dict[str, Registration]:
    """Every collector, in registration order."""
    return registrations()
