"""What a worker's engine holds, as placement sees it: the prefix chains (shared.protocol.prefixes) of the jobs it
ran, least recently used dropped first past its capacity, kept in Redis as a set of its own (keys.prefixes),
changed by what changed since the last write that went through: as a job starts (in the publisher's next write,
so that dispatch sees it for the very next job) and with each heartbeat (which retries what failed); it expires
with the heartbeat (a dead worker's set goes by itself)."""

from __future__ import annotations

from collections import OrderedDict

from shared.protocol import bus, keys, prefixes
from shared.redisio.rawpipe import Arg, PipelineLike

TOKENS_PER_LINK = prefixes.CHUNK_CHARS // 4
"""A link names about 1 KiB of text: some 256 tokens of English."""

Changes = tuple[set[str], set[str]]
"""Links added and dropped, as one write sent them."""


def capacity_for(summary_size: int, cache_tokens: int) -> int:
    """Links a worker reports at most: as many as its engine's cache holds prompts of (eviction approximated by
    the summary's own), no more than --prefix-summary-size; that alone where the cache's size is unknown."""
    if cache_tokens <= 0 or summary_size <= 0:
        return summary_size
    return max(1, min(summary_size, cache_tokens // TOKENS_PER_LINK))


class PrefixSummary:
    def __init__(self, model: str, worker_id: str, capacity: int, ttl_ms: int) -> None:
        self.key = keys.prefixes(model, worker_id)
        self.capacity = capacity
        self.ttl_ms = ttl_ms
        """The heartbeat's: the set goes with it."""
        self.links: OrderedDict[str, None] = OrderedDict()
        self.added: set[str] = set()
        """Held, not yet written."""
        self.dropped: set[str] = set()
        """No longer held, not yet removed."""

    def ran(self, job: bus.Job) -> bool:
        """The job's prompt went through the engine: its links are held, the most recently used. True if that
        changed the set."""
        if self.capacity <= 0:
            return False
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
        return bool(self.added or self.dropped)

    def commands(self) -> tuple[list[tuple[Arg, ...]], Changes]:
        """The writes of the changes and the set's renewed expiry, and the changes, for `written` once they went
        through."""
        added, dropped = set(self.added), set(self.dropped)
        commands: list[tuple[Arg, ...]] = []
        if added:
            commands.append(("SADD", self.key, *sorted(added)))
        if dropped:
            commands.append(("SREM", self.key, *sorted(dropped)))
        if self.links:
            commands.append(("PEXPIRE", self.key, self.ttl_ms))
        return commands, (added, dropped)

    def write(self, pipe: PipelineLike) -> Changes:
        """Adds `commands` to a pipeline; returns the changes."""
        commands, changes = self.commands()
        for command in commands:
            pipe.execute_command(*command)
        return changes

    def written(self, changes: Changes, replies: list[object]) -> None:
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
