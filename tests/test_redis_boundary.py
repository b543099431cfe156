"""The one place a Redis failure becomes an API error: which failures, and the error a client sees."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from services.edge.redis_boundary import MESSAGE, redis_boundary
from shared.protocol.errors import InvalidRequest, Overloaded, Unavailable


@pytest.mark.parametrize("failure", [RedisConnectionError("gone"), ResponseError("LOADING"), OSError("reset"),
                                     TimeoutError()])
def test_a_redis_failure_is_a_503_redis_unavailable(failure: Exception) -> None:
    with pytest.raises(Unavailable) as caught, redis_boundary():
        raise failure
    error = caught.value
    assert (error.status, error.type, error.code, error.message) == (503, "overloaded_error", "redis_unavailable",
                                                                     MESSAGE)
    assert error.__cause__ is failure


def test_the_stored_responses_keep_their_plain_overloaded() -> None:
    with pytest.raises(Overloaded) as caught, redis_boundary(Overloaded):
        raise RedisConnectionError("gone")
    assert type(caught.value) is Overloaded and caught.value.code is None and caught.value.message == MESSAGE


def test_other_errors_pass_through() -> None:
    with pytest.raises(InvalidRequest), redis_boundary():
        raise InvalidRequest("no")
    with redis_boundary():
        pass
