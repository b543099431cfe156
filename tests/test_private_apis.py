"""Each private name of a library that tokenbus uses, looked up on the release installed: when a new release drops
one, its test names the symbol, the release and the module that needs it. pyproject.toml caps aiohttp, redis and
hiredis at the releases that pass; lifting a cap starts here."""

from __future__ import annotations

import inspect
import platform
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import import_module, metadata
from typing import Any

import hiredis
import pytest
import redis.asyncio as aioredis
from aiohttp import web

REDIS_INTERNALS, SERVER, SSE = "shared/redisio/internals.py", "services/edge/server.py", "services/edge/sse.py"


@dataclass(frozen=True)
class Private:
    library: str
    """The distribution whose release is named, or python for the standard library's."""
    owner: str
    """A module or class (dotted), or one of LIVE."""
    name: str
    """The attribute, or a dotted path of them."""
    used_by: str

    def __str__(self) -> str:
        return f"{LIVE.get(self.owner, self.owner)}.{self.name}"


LIVE = {"connection": "redis.asyncio.Connection", "server": "aiohttp.web_server.Server",
        "handler": "aiohttp.web_protocol.RequestHandler"}
"""The objects whose private attributes are set at run time, looked up on an instance: a connection to the tests'
Redis (with hiredis's parser), a low-level server and the connection protocol it makes."""


PRIVATE = [
    Private("redis", "redis._parsers.hiredis", "NOT_ENOUGH_DATA", REDIS_INTERNALS),
    Private("redis", "connection", "_parser", REDIS_INTERNALS),
    Private("redis", "connection", "_parser._reader", REDIS_INTERNALS),
    Private("redis", "connection", "_parser.read_from_socket", REDIS_INTERNALS),
    Private("redis", "connection", "_parser._hiredis_PushNotificationType", REDIS_INTERNALS),
    Private("redis", "connection", "_writer.transport", REDIS_INTERNALS),
    Private("redis", "connection", "_reader", REDIS_INTERNALS),
    Private("python", "connection", "_reader._buffer", REDIS_INTERNALS),
    Private("python", "connection", "_reader._paused", REDIS_INTERNALS),
    Private("aiohttp", "aiohttp.web_runner.AppRunner", "_make_server", SERVER),
    Private("aiohttp", "server", "_kwargs", SERVER),
    Private("aiohttp", "server", "request_factory", SERVER),
    Private("aiohttp", "server", "request_handler", SERVER),
    Private("aiohttp", "server", "handler_cancellation", SERVER),
    Private("aiohttp", "handler", "_close", SERVER),
    Private("aiohttp", "handler", "_force_close", SERVER),
    Private("aiohttp", "aiohttp.web_response.StreamResponse", "_send_headers_immediately", SSE),
]

OVERRIDDEN = {
    # services.edge.server._Connection's overrides of aiohttp's RequestHandler, by the parameters they take
    "data_received": ["self", "data"],
    "finish_response": ["self", "request", "resp", "start_time"],
    "handle_error": ["self", "request", "status", "exc", "message"],
    "force_close": ["self"],
}


def release(library: str) -> str:
    return f"Python {platform.python_version()}" if library == "python" else \
        f"{library} {metadata.version(library)}"


def look_up(owner: Any, path: str) -> Any:
    for name in path.split("."):
        owner = getattr(owner, name)
    return owner


def imported(dotted: str) -> Any:
    """A module, or a class in one."""
    try:
        return import_module(dotted)
    except ImportError:
        module, _, name = dotted.rpartition(".")
        return getattr(import_module(module), name)


async def answer(request: web.BaseRequest) -> web.StreamResponse:
    return web.Response()


@pytest.fixture(scope="module")
async def live(redis_url: str) -> AsyncIterator[dict[str, Any]]:
    """An instance of each of LIVE."""
    client = aioredis.Redis.from_url(redis_url)
    connection = await client.connection_pool.get_connection()
    server = web.Server(answer)
    try:
        await connection.connect()
        yield {"connection": connection, "server": server, "handler": server()}
    finally:
        await client.connection_pool.release(connection)
        await client.aclose()


@pytest.mark.parametrize("private", PRIVATE, ids=str)
async def test_each_private_name_is_there(private: Private, live: dict[str, Any]) -> None:
    try:
        look_up(live[private.owner] if private.owner in LIVE else imported(private.owner), private.name)
    except (ImportError, AttributeError):
        pytest.fail(f"{release(private.library)} removed `{private}`, used by {private.used_by}", pytrace=False)


async def test_the_hiredis_parser_is_the_one_read_from(live: dict[str, Any]) -> None:
    """rawpipe and the relay take replies from the parser's reader: hiredis's, where redis-py could fall back to
    its own Python parser (whose reader is something else) without a word."""
    reader = live["connection"]._parser._reader
    assert isinstance(reader, hiredis.Reader), \
        f"{release('redis')} reads with {type(reader).__name__}, not hiredis.Reader: {REDIS_INTERNALS} needs it"


@pytest.mark.parametrize("method", sorted(OVERRIDDEN))
def test_the_request_handler_methods_the_edge_overrides_keep_their_parameters(method: str) -> None:
    from aiohttp.web_protocol import RequestHandler

    parameters = list(inspect.signature(getattr(RequestHandler, method)).parameters)
    assert parameters == OVERRIDDEN[method], \
        f"{release('aiohttp')} changed `RequestHandler.{method}`{tuple(parameters)}, overridden by {SERVER}"
