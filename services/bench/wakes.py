"""What one wake of a process costs this machine in CPU, whatever the process then does: the floor under every
per-token figure at low concurrency, where each token is a wake of each process it crosses (tokenbus: the
worker, Redis and the edge; `vllm serve`: its API server).

A child process writes one byte to a socket pair every `gap_s`; the measuring process sleeps until it comes, in
three ways: in a blocking epoll (C, the least a process can do), in an event loop awaiting the socket (uvloop,
as the edge and the worker run), and in an event loop woken by its own timer instead. Its own CPU time over the
wakes, divided by their number, is the figure.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvloop


@dataclass(frozen=True)
class WakeCost:
    """CPU microseconds per wake of one process."""

    wakes: int
    gap_ms: float
    epoll_us: float
    """A blocking epoll_wait woken by the socket, then one recv: the kernel's and the machine's share."""
    loop_socket_us: float
    """An event loop (uvloop) whose task awaits the socket (asyncio streams)."""
    loop_timer_us: float
    """An event loop whose task sleeps on a timer for `gap_ms`."""


@contextmanager
def _ticking(wakes: int, gap_s: float) -> Iterator[socket.socket]:
    """The receiving end of a socket pair that a child process writes one byte to every `gap_s`, `wakes` times."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ours.close()
        for _ in range(wakes):
            time.sleep(gap_s)
            theirs.send(b"x")
        os._exit(0)
    theirs.close()
    try:
        yield ours
    finally:
        ours.close()
        os.waitpid(pid, 0)


def _epoll(wakes: int, gap_s: float) -> float:
    with _ticking(wakes, gap_s) as sock, select.epoll() as poller:
        poller.register(sock.fileno(), select.EPOLLIN)
        started = time.process_time()
        for _ in range(wakes):
            poller.poll()
            sock.recv(1)
        return (time.process_time() - started) / wakes * 1e6


def _loop_socket(wakes: int, gap_s: float) -> float:
    with _ticking(wakes, gap_s) as sock:

        async def wait_all() -> float:
            reader, writer = await asyncio.open_connection(sock=sock.dup())  # the loop closes its own
            await reader.readexactly(1)  # the loop is set up and running
            started = time.process_time()
            for _ in range(wakes - 1):
                await reader.readexactly(1)
            cost = (time.process_time() - started) / (wakes - 1) * 1e6
            writer.close()
            await writer.wait_closed()
            return cost

        return uvloop.run(wait_all())


def _loop_timer(wakes: int, gap_s: float) -> float:
    async def wait_all() -> float:
        await asyncio.sleep(gap_s)
        started = time.process_time()
        for _ in range(wakes):
            await asyncio.sleep(gap_s)
        return (time.process_time() - started) / wakes * 1e6

    return uvloop.run(wait_all())


def measure(wakes: int = 300, gap_s: float = 0.02) -> WakeCost:
    """About 3 * wakes * gap_s seconds."""
    return WakeCost(wakes, gap_s * 1000, _epoll(wakes, gap_s), _loop_socket(wakes, gap_s), _loop_timer(wakes, gap_s))
