"""Dashboard uids: the dashboards, the alerts' dashboard links and the tests import them from here."""

FLEET = "gpuscope-fleet"
KERNELS = "gpuscope-kernels"
SLO = "gpuscope-slo"
TENANTS = "gpuscope-tenants"
BOTTLENECKS = "gpuscope-bottlenecks"
LOGS = "gpuscope-logs"

ALL = (FLEET, KERNELS, SLO, TENANTS, BOTTLENECKS, LOGS)
