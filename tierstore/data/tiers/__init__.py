"""Tier engines: plain classes that hold shard bytes within a byte bound."""
