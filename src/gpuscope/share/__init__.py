"""GPU-time shares between separate processes on a node's GPUs (`gpuscope share`, docs/share.md)."""
