"""What a worker's engine holds, as placement sees it: the prefix chains (shared.protocol.prefixes) of the jobs it
ran, least recently used dropped first past its capacity, kept in Redis as a set of its own (keys.prefixes),
changed with each heartbeat by what changed since the last write that went through, and expiring with the
heartbeat (a dead worker's set goes by itself)."""

from __future__ import annotations

from collections import OrderedDict

from shared.protocol import bus, keys, prefixes
from shared.redisio.rawpipe import PipelineLike


class PrefixSummary:
    def __init__(self, model: str, worker_id: str, capacity: int) -> None:
        self.key = keys.prefixes(model, worker_id)
        self.capacity = capacity
        self.links: OrderedDict[str, None] = OrderedDict()
        self.added: set[str] = set()
        """Held, not yet written."""
        self.dropped: set[str] = set()
        """No longer held, not yet removed."""

    def ran(self, job: bus.Job) -> None:
        """The job's prompt went through the engine: its links are held, the most recently used."""
        if self.capacity <= 0:
            return
        for link in prefixes.chain(job):
            if link not in self.links:
                self.added.add(link)
                self.dropped.discard(link)
            self.links[link] = None
            self.links.move_to_end(link)
        while len(self.links) > self.capacity:
            link, _ = self.links.popitem(last=False)
            if link in self.added:
                self.added.discard(link)
            else:
                self.dropped.add(link)

    def write(self, pipe: PipelineLike, ttl_ms: int) -> tuple[set[str], set[str]]:
        """Adds the changes and the set's renewed expiry to a pipeline; returns the changes, for `written` once
        the pipeline went through."""
        added, dropped = set(self.added), set(self.dropped)
        if added:
            pipe.execute_command("SADD", self.key, *sorted(added))
        if dropped:
            pipe.execute_command("SREM", self.key, *sorted(dropped))
        if self.links:
            pipe.execute_command("PEXPIRE", self.key, ttl_ms)
        return added, dropped

    def written(self, changes: tuple[set[str], set[str]], replies: list[object]) -> None:
        """The pipeline of `write` went through, with these replies to its commands: the changes are in Redis
        unless one failed (then they go again with the next write)."""
        if any(isinstance(reply, Exception) for reply in replies):
            return
        added, dropped = changes
        self.added -= added
        self.dropped -= dropped

    def lost(self) -> None:
        """Redis lost the set (it expired while the heartbeat could not reach Redis): everything held is written
        again."""
        self.added, self.dropped = set(self.links), set()

    def forget(self, pipe: PipelineLike) -> None:
        """Removes the set (the worker stops)."""
        pipe.execute_command("DEL", self.key)
