"""The least that two hops through Redis cost this machine in latency: the floor that tokenbus's own work sits on
in the hop overhead (edge_bench.hop_overhead), whatever that work is made of.

Two processes and a Redis run as tokenbus runs its private one (services.supervisor.REDIS_ARGS, over a Unix
socket): the first publishes a message on a channel the second subscribes to, and the second publishes it back
on a channel the first subscribes to. That is edge -> Redis -> worker -> Redis -> edge, the way a job goes to its
worker and its first event comes back, with nothing else done: the raw protocol over uvloop, parsed by hiredis,
replies of the publishes left unread (as the worker's token writes leave theirs); no validation, encoding,
scripts, tasks or HTTP. One round trip at a time, `gap_s` apart, so that each pays the wakes of all three
processes; on the core the systems get when the hop overhead is measured with the load generator apart.

Run (what the harness starts): python -m services.bench.floor echo|ping REDIS_SOCKET [ROUND_TRIPS GAP_S]
"""

from __future__ import annotations

import asyncio
import json
import subprocess  # nosec B404: runs our own programs, never a shell
import sys
import time
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlparse

import hiredis

from services.bench import edge_bench
from services.bench.stats import Summary
from services.supervisor import private_redis
from shared.redisio.rawpipe import pack
from shared.runtime import eventloop

THERE, BACK = "floor:there", "floor:back"
READY = "subscribed"


@dataclass(frozen=True)
class HopFloor:
    round_trips: int
    gap_ms: float
    one_core: bool
    """The three processes shared one core (the systems' core of the pinned hop measurement)."""
    round_trip_us: Summary


async def _subscribed(path: str, channel: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, hiredis.Reader]:
    """A subscription: its reader, its writer (kept: a collected StreamWriter closes its connection) and parser."""
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(pack(("SUBSCRIBE", channel)))
    parser = hiredis.Reader()
    while (reply := parser.gets()) is False:
        parser.feed(await reader.read(65536))
    assert reply[0] == b"subscribe", reply  # nosec B101: an invariant (tokenbus never runs with -O)
    return reader, writer, parser


async def _publisher(path: str) -> asyncio.StreamWriter:
    """A connection that publishes and never reads its replies (they would wake the process)."""
    _reader, writer = await asyncio.open_unix_connection(path)
    cast(asyncio.ReadTransport, writer.transport).pause_reading()
    return writer


async def _messages(reader: asyncio.StreamReader, parser: hiredis.Reader) -> bytes:
    """The payload of the next message on a subscription."""
    while True:
        while (reply := parser.gets()) is not False:
            if reply[0] == b"message":
                return bytes(reply[2])
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("Redis closed the subscription")
        parser.feed(data)


async def echo(path: str) -> None:
    """Sends every message that comes on THERE back on BACK, until Redis goes away."""
    reader, _writer, parser = await _subscribed(path, THERE)
    out = await _publisher(path)
    print(READY, flush=True)
    while True:
        out.write(pack(("PUBLISH", BACK, await _messages(reader, parser))))


async def ping(path: str, round_trips: int, gap_s: float) -> list[float]:
    """Each round trip's time, in microseconds."""
    reader, _writer, parser = await _subscribed(path, BACK)
    out = await _publisher(path)
    times: list[float] = []
    for number in range(round_trips):
        await asyncio.sleep(gap_s)
        sent = time.perf_counter()
        out.write(pack(("PUBLISH", THERE, str(number))))
        while int(await _messages(reader, parser)) != number:
            pass
        times.append((time.perf_counter() - sent) * 1e6)
    return times


def measure(round_trips: int = 300, gap_s: float = 0.01, pin: bool = True) -> HopFloor:
    pin = pin and edge_bench.can_pin()
    run = [sys.executable, "-m", "services.bench.floor"]
    with edge_bench.pinned_apart(pin), private_redis(unix_socket=True) as url:
        path = urlparse(url).path
        with subprocess.Popen([*run, "echo", path], stdout=subprocess.PIPE, text=True) as echoer:  # nosec B603: our own argv, no shell
            try:
                assert echoer.stdout is not None and echoer.stdout.readline().strip() == READY, "no echo"  # nosec B101: an invariant (tokenbus never runs with -O)
                pinged = subprocess.run([*run, "ping", path, str(round_trips), str(gap_s)], capture_output=True,  # nosec B603: our own argv, no shell
                                        text=True, check=True, timeout=60 + round_trips * gap_s * 4)
            finally:
                echoer.terminate()
    return HopFloor(round_trips, gap_s * 1000, pin, Summary.of(json.loads(pinged.stdout)))


def main() -> None:
    role, path = sys.argv[1], sys.argv[2]
    if role == "echo":
        eventloop.run(echo(path), "uvloop")
    else:
        times = eventloop.run(ping(path, int(sys.argv[3]), float(sys.argv[4])), "uvloop")
        print(json.dumps(times))


if __name__ == "__main__":
    main()
