"""The stateless HTTP edge: validates requests, enqueues jobs on Redis, renders events as SSE or JSON."""
