"""The one place tokenbus reaches into redis-py's private parts: a connection's transport, its hiredis reader and
the stream reader redis-py reads through. The raw pipelines and the listeners need them to skip redis-py's
per-reply Python; a redis-py upgrade that moves any of them is changed here and nowhere else
(tests/test_private_apis.py names each attribute on the release installed). Connections are typed Any:
redis-py's own are private classes."""

from __future__ import annotations

import asyncio
from typing import Any

try:
    from redis._parsers.hiredis import NOT_ENOUGH_DATA  # what its hiredis reader answers for a partial reply
except ImportError:  # pragma: no cover - a redis-py that moved it: its own reads are used
    NOT_ENOUGH_DATA = None


def transport(connection: Any) -> asyncio.Transport | None:
    """The connection's socket transport; None when it is not connected."""
    writer = getattr(connection, "_writer", None)
    return None if writer is None else writer.transport


def is_open(connection: Any) -> bool:
    """Connected, and its transport not closing (a write that found the socket gone closes it)."""
    found = transport(connection)
    return found is not None and not found.is_closing()


def hiredis_reader(connection: Any) -> Any:
    """The connection's hiredis reader (replies taken with `gets()`, NOT_ENOUGH_DATA when none is whole); None
    with redis-py's Python parser, or a redis-py that changed."""
    return None if NOT_ENOUGH_DATA is None else getattr(connection._parser, "_reader", None)


def push_type(connection: Any) -> type | None:
    """The class of RESP3 push messages its hiredis reader makes (nobody's reply), if any."""
    return getattr(connection._parser, "_hiredis_PushNotificationType", None)


async def read_from_socket(connection: Any) -> None:
    """One read of the socket into the connection's parser."""
    await connection._parser.read_from_socket()


def take_stream(connection: Any) -> tuple[bytes, bool]:
    """Empties the stream reader redis-py reads the connection through, for a protocol that takes the transport
    over: the bytes it had read but not yet parsed, and whether its full buffer had paused the transport's reads
    (it is unpaused: whoever takes over resumes them)."""
    stream = connection._reader
    buffered = bytes(stream._buffer)
    stream._buffer.clear()
    paused, stream._paused = stream._paused, False
    return buffered, paused
