"""The node's shared-memory arena: the CPU tier's bytes, mapped by every worker of the node."""
