"""A node's store without Ray: the NodeStore's logic and the ports it needs of the cluster."""
