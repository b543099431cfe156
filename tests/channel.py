"""Listening on an edge's events channel as an edge would, for tests that play the edge themselves."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import redis

from shared.protocol import bus


class Listener:
    """A subscription to one events channel, taken before the job is enqueued (pub/sub keeps nothing for
    those who subscribe late)."""

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self.pubsub = client.pubsub()
        self.pubsub.ssubscribe(channel)
        confirmed = self.pubsub.get_sharded_message(timeout=5)
        assert confirmed is not None and confirmed["type"] == "ssubscribe", confirmed

    def events(self, wait_s: float) -> list[tuple[float, bus.Event]]:
        """The events published until a Final or an Error, or for `wait_s`, each with when it arrived."""
        deadline = time.monotonic() + wait_s
        events: list[tuple[float, bus.Event]] = []
        while time.monotonic() < deadline and not any(isinstance(e, bus.Final | bus.Error) for _t, e in events):
            message = self.pubsub.get_sharded_message(ignore_subscribe_messages=True, timeout=0.05)
            if message is not None:
                events += [(time.monotonic(), e) for e in bus.decode_events(message["data"])]
        return events


@contextlib.contextmanager
def listening(client: redis.Redis, channel: str) -> Iterator[Listener]:
    listener = Listener(client, channel)
    try:
        yield listener
    finally:
        listener.pubsub.close()
