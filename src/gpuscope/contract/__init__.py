"""The contract: what every part of the bundle must agree on, and nothing else.

The ground floor of the package: these modules import nothing of gpuscope outside this package, and
every other package may import them.

- ``catalogue``: every gpuscope metric (name, type, help, unit, labels, buckets);
- ``upstream``: the metrics of the other programs the bundle reads (vLLM, dcgm-exporter);
- ``names``: the recording rules' names, which dashboards and other rules read;
- ``uids``: the dashboards' and the Grafana datasources' uids;
- ``parts``: the bundle's parts (name, default port, scrape job, service label);
- ``profiles``: the alert configuration (selectors, thresholds, windows, links) and its profiles;
- ``spans``: the span attributes the server writes and the Collector's sampling policy reads;
- ``tenants``: what a tenant name may be;
- ``choices``: the string choices several parts name (the metric-name sets, the alert profiles, the
  server's sources), as enums.
"""
