"""tierstore's Ray actors: a NodeStore per node and one cluster-wide Evictor."""
