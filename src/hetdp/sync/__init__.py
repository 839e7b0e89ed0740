"""How the ranks' contributions combine: every step (allreduce), without the slowest (partial), or now and then (local)."""
