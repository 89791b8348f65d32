"""Load tests for gpuscope's server: Locust users and shapes, exact figures, comparisons, alert runs.

Modules, one job each:

* ``distributions`` – prompt/output length specs and seeded draws;
* ``shapes`` – stage tables (steady, ramp, step, spike) and the Locust shape;
* ``sse`` – parsing a streamed completion and its timings;
* ``options`` – the options gpuscope adds to Locust, and the workload they describe;
* ``users`` – the streaming user and one weighted class per tenant;
* ``locustfile`` – what ``locust -f loadtest/`` loads: the tenants' user classes and the shape;
* ``plugin`` – Locust listeners: options, and the exact recorder across processes;
* ``recorder`` / ``stats`` – exact per-request records, percentiles and rates;
* ``configs`` – the server configurations a comparison sets side by side;
* ``targets`` – endpoints a comparison loads but does not start (``--target NAME=URL``);
* ``serverproc`` – ``gpuscope serve`` as a child process on a free local port;
* ``runtools`` – duration flags and where Locust is, shared by the commands;
* ``report`` / ``plots`` – a comparison's CSV, Markdown table and PNG figures;
* ``compare`` – the comparison command (``python -m gpuscope.loadtest.compare``);
* ``alertwatch`` – reading alerts back from the receiver, Alertmanager and Prometheus;
* ``fault_drill`` – the alert drill under load (``python -m gpuscope.loadtest.fault_drill``).

Importing this package imports nothing from Locust, so the pure parts work
without gevent's monkey-patching.
"""

from gpuscope.loadtest.distributions import LengthDistribution, parse_distribution
from gpuscope.loadtest.recorder import Recorder, load_samples
from gpuscope.loadtest.stats import Summary, percentile, summarise

__all__ = ["LengthDistribution", "Recorder", "Summary", "load_samples", "parse_distribution",
           "percentile", "summarise"]
