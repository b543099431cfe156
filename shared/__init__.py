"""What the edge and the worker both import, by concern: `protocol` (the bus between them), `redisio` (how they
reach Redis), `tenancy` (keys, limits, fair share, storage) and `runtime` (settings, metrics, logs, the loop)."""
