"""Benchmarks: each measures tierstore against a baseline in the same run and reports ratios."""
