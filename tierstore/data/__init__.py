"""Data plane: chunk layout, checksums and the tiers that hold chunk bytes (no Ray here)."""
