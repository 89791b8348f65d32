"""GPU-time shares between separate processes on one GPU (`gpuscope share`, docs/share.md)."""
