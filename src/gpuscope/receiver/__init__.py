"""``gpuscope receiver``: the Alertmanager webhook receiver (``main``), and the kernel profiles it asks
servers for when a latency alert fires (``profile_trigger``)."""
