"""The worker: pulls jobs for one model from Redis, runs them in vLLM, publishes token events."""
