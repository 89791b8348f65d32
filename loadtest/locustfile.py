"""``locust -f loadtest/``: streaming completions per tenant, stage-table shapes.

The definitions live in the gpuscope package (``gpuscope.loadtest.locustfile``)
so the comparison command runs the same ones; see docs/loadtest.md.
"""

from gpuscope.loadtest.locustfile import *  # noqa: F403
