"""The tierstore CLI, cluster bootstrap, serving helpers and benchmark jobs."""
