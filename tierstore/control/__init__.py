"""Control plane: the cluster index, leases, capacity accounting and eviction policy (no Ray)."""
