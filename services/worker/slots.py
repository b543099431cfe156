"""A worker's sequence slots: a job takes as many as it runs sequences, in the order the jobs arrived."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class Slots:
    """`total` slots taken first come, first served: a job that does not fit waits, and no later job, however small,
    goes before it, so a wide job waits only for the slots ahead of it to free, never for ever."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0
        self.waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def open(self) -> int:
        """Slots a new job may take now: none while a job waits for its slots (it goes first)."""
        return 0 if self.waiting else self.total - self.used

    def need(self, sequences: int) -> int:
        """The slots a job of `sequences` takes: a job wider than the worker takes them all, and the engine queues
        the rest of its sequences (the edge refuses such jobs; one may still come from a larger worker)."""
        return max(1, min(sequences, self.total))

    @contextlib.asynccontextmanager
    async def held(self, sequences: int) -> AsyncIterator[None]:
        """Holds the job's slots for the block, once the jobs that came before it have theirs."""
        need = self.need(sequences)
        if self.waiting or self.used + need > self.total:
            waiter = asyncio.get_running_loop().create_future()
            self.waiting.append((need, waiter))
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # granted as it was cancelled: give them back
                    self._release(need)
                else:  # gone from the line (or already skipped by a wake): those behind it may fit now
                    with contextlib.suppress(ValueError):
                        self.waiting.remove((need, waiter))
                    self._wake()
                raise
        else:
            self.used += need
        try:
            yield
        finally:
            self._release(need)

    def _release(self, slots: int) -> None:
        self.used -= slots
        self._wake()

    def _wake(self) -> None:
        """Grants the waiting jobs their slots in order while the first of them fits."""
        while self.waiting and (self.waiting[0][1].done() or self.used + self.waiting[0][0] <= self.total):
            need, waiter = self.waiting.popleft()
            if not waiter.done():  # a cancelled one gave up its place
                self.used += need
                waiter.set_result(None)
