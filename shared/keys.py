"""Every Redis key, stream, group and channel name tokenbus uses, in one place."""

PREFIX = "tokenbus"

WORKER_GROUP = "workers"
"""Consumer group that every worker of a model reads its request stream through."""

CANCEL_CHANNEL = f"{PREFIX}:cancel"
"""Pub/sub channel on which edges name jobs to abort; every worker listens."""

WORKERS = f"{PREFIX}:workers"
"""Sorted set of worker heartbeat keys, scored by when each last beat expires (unix seconds): edges read
the live workers from it instead of scanning the keyspace."""


def requests_stream(model: str) -> str:
    """The stream of jobs for one model, read by its workers through WORKER_GROUP."""
    return f"{PREFIX}:requests:{{{model}}}"


def events_stream(edge_id: str) -> str:
    """The stream on which workers publish token events for the jobs of one edge process."""
    return f"{PREFIX}:events:{{{edge_id}}}"


def worker_heartbeat(model: str, worker_id: str) -> str:
    """A worker's heartbeat: it expires when the worker stops refreshing it."""
    return f"{PREFIX}:worker:{model}:{worker_id}"


def cancelled(job_id: str) -> str:
    """Marks a job cancelled, so a worker that picks it up later never starts it."""
    return f"{PREFIX}:cancelled:{job_id}"


def stored_response(response_id: str) -> str:
    """A finished Responses-API response and its conversation, for GET and previous_response_id."""
    return f"{PREFIX}:response:{response_id}"
