"""The simulated engine's prefill lane: one prefill runs at a time, in chunks, the most urgent first, as an engine
spends each step's token budget on its waiting requests in priority order."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

CHUNK_TOKENS = 512
"""Prompt tokens a prefill runs before the lane looks again for a more urgent one (chunked prefill)."""


@dataclass(order=True)
class _Prefill:
    priority: int
    arrival: int
    left: int = field(compare=False)
    done: asyncio.Future[None] = field(compare=False)


class PrefillLane:
    """Prefills of `s_per_token` seconds per prompt token, one at a time: a lower priority value first, then the
    earlier arrival; a more urgent one waits at most for the chunk under way."""

    def __init__(self, s_per_token: float) -> None:
        self.s_per_token = s_per_token
        self.waiting: list[_Prefill] = []
        self.arrivals = itertools.count()
        self.runner: asyncio.Task[None] | None = None

    async def prefill(self, tokens: int, priority: int) -> None:
        """Until a prompt of `tokens` went through the lane."""
        if self.s_per_token <= 0 or tokens <= 0:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting, _Prefill(priority, next(self.arrivals), tokens, done))
        if self.runner is None:
            self.runner = asyncio.create_task(self._run())
        await done

    async def _run(self) -> None:
        while self.waiting:
            head = self.waiting[0]
            if head.done.done():  # its caller went away
                heapq.heappop(self.waiting)
                continue
            chunk = min(head.left, CHUNK_TOKENS)
            await asyncio.sleep(chunk * self.s_per_token)
            head.left -= chunk
            if head.left <= 0:
                self.waiting.remove(head)  # a more urgent one may have come to the top meanwhile
                heapq.heapify(self.waiting)
                if not head.done.done():
                    head.done.set_result(None)
        self.runner = None

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.cancel()
