"""The one place a Redis failure becomes an API error: what counts as one, and the error a client sees for it.

A call that cannot answer without Redis goes through `redis_boundary()`; a failure found another way (the relay's
reader knows Redis is down) raises `unavailable()`; the app's error middleware turns whatever escapes both into the
same error. Calls that can do without Redis (a cancel sent later, a lease left to expire) catch REDIS_FAILURES
themselves and carry on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis.exceptions import RedisError

from shared.protocol.errors import Overloaded, Unavailable

REDIS_FAILURES = (RedisError, OSError)
"""What a Redis call raises when Redis cannot answer: redis-py's errors, or a socket's (TimeoutError, a deadline's
too, is an OSError)."""

MESSAGE = "The service cannot reach its queue; try again shortly."
"""Its queue: Redis, which holds the jobs, their events, the limits and the stored responses."""


def unavailable(error: type[Overloaded] = Unavailable) -> Overloaded:
    """The API error of a Redis that cannot answer: 503 `redis_unavailable`."""
    return error(MESSAGE)


@contextlib.contextmanager
def redis_boundary(error: type[Overloaded] = Unavailable) -> Iterator[None]:
    """Turns a Redis failure in the block into `unavailable(error)`; `error`: the stored responses' 503 has
    always been a plain Overloaded (no code), kept so."""
    try:
        yield
    except REDIS_FAILURES as exc:
        raise unavailable(error) from exc
