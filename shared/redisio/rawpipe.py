"""Lean Redis pipelines: commands packed by hiredis in C and sent in one write, their replies read back raw.
The worker publisher's per-token write runs on a connection held for good; the edge's housekeeping loops
(registry reads, heartbeats) on one of the pool's connections per call. redis-py's own pipeline checks and
converts every argument and reply in Python and checks a connection out of its pool per call: with many streams
that was a large share of the worker's CPU, most of it per streamed token, and a small pipeline costs its client
several times the CPU in redis-py that it costs raw.

A Redis Cluster client keeps redis-py's pipeline (it routes each command to its slot's node); both are used
through the same few methods, `PipelineLike`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.redisio import internals
from shared.redisio.clients import COMMAND_TIMEOUT_S
from shared.redisio.internals import NOT_ENOUGH_DATA

Arg = bytes | str | int | float
pack = cast(Callable[[tuple[Arg, ...]], bytes], hiredis.pack_command)  # its stub takes 1-tuples only
"""One command in Redis's protocol, packed in C (redis-py packs in Python, converting every argument)."""


def streams_entries(reply: Any) -> Iterator[tuple[Any, Any]]:
    """Each stream of an XREAD or XREADGROUP reply, with its entries (id, fields): RESP3 answers {stream: entries},
    RESP2 [[stream, entries]]; fields come as Redis sent them (a flat list) or as redis-py parsed them (a dict)."""
    yield from (reply.items() if isinstance(reply, dict) else reply or ())


def field_map(reply: Any) -> dict[Any, Any]:
    """A map in a reply (an entry's fields, an XINFO record) as Redis sends it raw (a flat [name, value, ...]
    list in RESP2) or as redis-py or RESP3 give it (a dict)."""
    return reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))


class PipelineLike(Protocol):
    """What the hot paths call on a pipeline: raw commands, then one execute."""

    def execute_command(self, *args: Any, **options: Any) -> Any: ...

    def __len__(self) -> int: ...

    async def execute(self, raise_on_error: bool = True) -> list[Any]: ...


class Span:
    """Where a group of commands lies in a pipeline, marked while they are added (`with Span(pipe) as part:`), so
    that their replies are taken by name rather than counted out by position."""

    def __init__(self, pipe: PipelineLike) -> None:
        self.pipe = pipe
        self.start = self.end = len(pipe)

    def __enter__(self) -> Span:
        self.start = self.end = len(self.pipe)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.end = len(self.pipe)

    def of(self, replies: list[Any]) -> list[Any]:
        """The replies of this group's commands among all the pipeline's."""
        return replies[self.start:self.end]


class RawPipeline:
    """Raw commands for one execute on a HeldConnection. A reply that is an error comes back as the exception,
    in its place; a failure of the connection raises (RedisError or OSError) and drops the connection."""

    def __init__(self, held: HeldConnection) -> None:
        self.held = held
        self.commands: list[tuple[Arg, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        del options  # a redis-py pipeline's routing hints; one connection needs none
        self.commands.append(args)

    def __len__(self) -> int:
        return len(self.commands)

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        commands, self.commands = self.commands, []
        replies = await self.held.run(commands)
        if raise_on_error and (failed := next((r for r in replies if isinstance(r, Exception)), None)):
            raise failed
        return replies


class HeldConnection:
    """One connection of a plain client's pool, taken at first use and kept (given back when it fails); with
    `keep` False, taken for each call and given back after it (for loops that run a few times a second, so
    that they do not hold a connection of a small pool for good).

    A kept connection may also send commands whose replies are read later (`send_unread`, `read_unread`):
    meanwhile it stops reading its socket, so that their arrival wakes nobody."""

    def __init__(self, client: aioredis.Redis, keep: bool = True) -> None:
        self.client = client
        self.keep = keep
        self.connection: Any = None
        self.lock = asyncio.Lock()
        """Held across a call: two calls' replies would interleave on the one connection."""
        self.unread = 0
        """Replies of commands sent by `send_unread`, not read yet."""
        self.lost_unread = False
        """The connection failed with replies unread: whether their commands ran is unknown."""

    async def run(self, commands: list[tuple[Arg, ...]]) -> list[Any]:
        if not commands:
            return []
        async with self.lock, asyncio.timeout(COMMAND_TIMEOUT_S):  # TimeoutError is an OSError, as callers expect
            if self.unread:
                raise RuntimeError("replies of earlier commands are still unread on this connection")
            try:
                return await self._run(commands)
            except RedisConnectionError:
                # a held connection can die while idle (Redis restarted): once more on a fresh one, as redis-py's
                # own pipeline retries a connection error
                return await self._run(commands)

    async def _run(self, commands: list[tuple[Arg, ...]]) -> list[Any]:
        connection = await self._connection()
        try:
            await connection.send_packed_command(b"".join(map(pack, commands)), check_health=False)
            replies = await read_replies(connection, len(commands))
        except BaseException:  # replies may be left unread: the connection cannot be used again
            await self._drop(connection)
            raise
        if not self.keep:
            self.connection = None
            await self.client.connection_pool.release(connection)
        return replies

    async def send_unread(self, commands: list[tuple[Arg, ...]]) -> None:
        """Sends commands and leaves their replies unread until `read_unread`; a failure raises (RedisError or
        OSError) and drops the connection with whatever was unread on it."""
        assert self.keep, "replies left unread need a connection that stays"  # nosec B101: an invariant (tokenbus never runs with -O)
        if self.try_send_unread(commands):
            return
        async with self.lock, asyncio.timeout(COMMAND_TIMEOUT_S):
            connection = await self._connection()
            try:
                await connection.send_packed_command(b"".join(map(pack, commands)), check_health=False)
            except BaseException:
                await self._drop(connection)
                raise
            self.unread += len(commands)
            if internals.is_open(connection):
                internals.transport(connection).pause_reading()  # type: ignore[union-attr]

    def try_send_unread(self, commands: list[tuple[Arg, ...]]) -> bool:
        """`send_unread` on the spot, when it can be: hands the commands to an open, idle connection's transport,
        which has room for them, without a task switch, a lock or a timer: the hot path of a worker's token
        writes. Each wake of a process costs more the more code it runs through, well beyond that code's own time
        (its caches are cold after the engine's step): at one stream, where every token is a wake, the worker
        spends less CPU per token with this and the publisher's single quiet timer. False: nothing was
        sent; `send_unread` sends them the careful way (connecting, waiting out a full buffer, failing)."""
        transport = None if self.connection is None or self.lock.locked() else internals.transport(self.connection)
        if transport is None or transport.is_closing() or transport.get_write_buffer_size() > 0:
            return False
        transport.write(b"".join(map(pack, commands)))
        self.unread += len(commands)
        if not transport.is_closing():  # else the write found the connection gone: `read_unread` will say so
            transport.pause_reading()
        return True

    async def read_unread(self) -> list[Any]:
        """The replies left unread, in order (an error reply as the exception in its place); a lost connection
        raises RedisConnectionError: whether those commands ran is unknown."""
        async with self.lock, asyncio.timeout(COMMAND_TIMEOUT_S):
            count, self.unread = self.unread, 0
            if self.lost_unread:
                self.lost_unread = False
                raise RedisConnectionError("the connection was lost with replies unread")
            if not count:
                return []
            connection = self.connection
            try:
                transport = internals.transport(connection)
                if transport is None or transport.is_closing():  # a write found it gone (a paused one can't resume)
                    raise RedisConnectionError("the connection was lost with replies unread")
                transport.resume_reading()
                return await read_replies(connection, count)
            except BaseException:
                await self._drop(connection)
                raise

    async def _connection(self) -> Any:
        if self.connection is not None and not internals.is_open(self.connection):
            await self._drop(self.connection)  # a write found it gone; uvloop refuses any use of it now
        if self.connection is None:
            self.connection = await self.client.connection_pool.get_connection()
        return self.connection

    async def _drop(self, connection: Any) -> None:
        self.lost_unread = self.lost_unread or self.unread > 0
        self.connection, self.unread = None, 0
        await connection.disconnect(nowait=True)
        await self.client.connection_pool.release(connection)


async def read_replies(connection: Any, count: int) -> list[Any]:
    """The next `count` replies on a connection, an error reply as the exception in its place. With hiredis
    (always installed: redis[hiredis]) they are taken from its reader as each socket read completes them, in C;
    redis-py's read_response costs a few Python calls and a timer check per reply, which a step's write of
    dozens of commands pays dozens of times. No timer per read: the caller bounds the whole call."""
    reader = internals.hiredis_reader(connection)
    if reader is None:  # redis-py's Python parser, or a redis-py that changed
        return [await _read_one(connection) for _ in range(count)]
    push = internals.push_type(connection)
    replies: list[Any] = []
    while len(replies) < count:
        reply = reader.gets()
        if reply is NOT_ENOUGH_DATA:
            try:
                await internals.read_from_socket(connection)
            except OSError as exc:
                raise RedisConnectionError(f"Error while reading from Redis: {exc}") from exc
        elif isinstance(reply, RedisConnectionError):
            raise reply
        elif push is None or not isinstance(reply, push):  # a push (RESP3 only) is nobody's reply here
            replies.append(reply)
    return replies


async def _read_one(connection: Any) -> Any:
    try:
        return await connection.read_response(timeout=math.inf)
    except ResponseError as exc:  # read whole: the next reply follows on the same connection
        return exc


class Pipelines:
    """Makes the pipelines of one loop (or of several, which then take turns): raw ones for a plain client, on
    a held connection (or, `keep` False, one of the pool's per call), redis-py's for a cluster."""

    def __init__(self, client: aioredis.Redis, keep: bool = True) -> None:
        self.client = client
        self.held = None if isinstance(client, RedisCluster) else HeldConnection(client, keep)

    def pipeline(self) -> PipelineLike:
        if self.held is None:
            return self.client.pipeline(transaction=False)
        return RawPipeline(self.held)


class Listener(asyncio.Protocol):
    """Takes over the transport of a connection that only listens (a subscription) from redis-py's stream
    reader: each socket read is fed to the connection's hiredis reader and `on_read` is called at once, in the
    callback that brought it, where the replies are taken with `reader.gets()`. A read through redis-py costs a
    future, a task switch and a few coroutine frames; at one stream the edge wakes for every token. The stream
    reader's protocol still hears of the connection's end (redis-py's disconnect waits for it). `ended` gets
    what ended the listening: the connection's loss, or an exception `on_read` raised."""

    def __init__(self, connection: Any, on_read: Callable[[], object]) -> None:
        self.reader = internals.hiredis_reader(connection)
        self.on_read = on_read
        self.ended: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
        transport = internals.transport(connection)
        assert transport is not None and self.reader is not None, "a connection, with hiredis"  # nosec B101: an invariant
        self.inner = cast(asyncio.Protocol, transport.get_protocol())
        # read from the socket, not yet by the parser: nothing arrives before set_protocol
        buffered, paused = internals.take_stream(connection)
        if buffered:
            self.reader.feed(buffered)
        transport.set_protocol(self)
        if paused:  # its buffer was full: the stream reader stopped the transport's reads
            transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.ended.done():
            return
        self.reader.feed(data)
        try:
            self.on_read()
        except Exception as exc:  # ends the listening; the connection is the owner's to drop
            self.ended.set_result(exc)

    def eof_received(self) -> bool | None:
        self.inner.eof_received()
        return False  # the server closed it: close the transport (a stream reader would keep it half-open)

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)
        if not self.ended.done():
            self.ended.set_result(RedisConnectionError(f"the connection was lost ({exc or 'closed by the server'})"))

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
