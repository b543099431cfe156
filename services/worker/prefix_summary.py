"""What a worker's engine holds, as placement sees it: the prefix chains (shared.protocol.prefixes) of the jobs it
ran, least recently used dropped first past its capacity, kept in Redis as a set of its own (keys.prefixes),
changed by what changed since the last write that went through: as a job starts (in the publisher's next write,
so that dispatch sees it for the very next job) and with each heartbeat (which retries what failed); it expires
with the heartbeat (a dead worker's set goes by itself)."""

from __future__ import annotations

from collections import OrderedDict

from shared.protocol import bus, keys, prefixes
from shared.redisio.rawpipe import Arg, PipelineLike

Changes = tuple[set[str], set[str]]
"""Links added and dropped, as one write sent them."""


class PrefixSummary:
    """`max_links` bounds the links; `cache_tokens` (0: unknown) the prompt tokens they stand for, as the engine's
    KV cache bounds what it holds: a link stands for its job's prompt tokens over its links (the edge's estimate at
    the start, the engine's count once the job ends), so the summary forgets about when the engine evicts."""

    def __init__(self, model: str, worker_id: str, max_links: int, ttl_ms: int, cache_tokens: int = 0) -> None:
        self.key = keys.prefixes(model, worker_id)
        self.max_links = max_links
        self.cache_tokens = cache_tokens
        self.ttl_ms = ttl_ms
        """The heartbeat's: the set goes with it."""
        self.links: OrderedDict[str, int] = OrderedDict()
        """Each held link, least recently used first, with the tokens it stands for."""
        self.tokens = 0
        """What the held links stand for, together."""
        self.added: set[str] = set()
        """Held, not yet written."""
        self.dropped: set[str] = set()
        """No longer held, not yet removed."""

    def ran(self, job: bus.Job) -> bool:
        """The job's prompt went through the engine: its links are held, the most recently used. True if that
        changed the set."""
        if self.max_links <= 0:
            return False
        chain = prefixes.chain(job)
        for link in chain:
            if link not in self.links:
                self.added.add(link)
                self.dropped.discard(link)
            self._weigh(link, max(1, job.prompt_estimate // len(chain)))
            self.links.move_to_end(link)
        self._evict()
        return bool(self.added or self.dropped)

    def counted(self, job: bus.Job, prompt_tokens: int) -> None:
        """The engine counted the job's prompt: its links held still stand for that, from now on."""
        if self.max_links <= 0 or not (chain := prefixes.chain(job)):
            return
        for link in chain:
            if link in self.links:
                self._weigh(link, max(1, prompt_tokens // len(chain)))
        self._evict()

    def _weigh(self, link: str, tokens: int) -> None:
        self.tokens += tokens - self.links.get(link, 0)
        self.links[link] = tokens

    def _evict(self) -> None:
        while len(self.links) > self.max_links or (self.cache_tokens and self.tokens > self.cache_tokens
                                                   and len(self.links) > 1):
            link, tokens = self.links.popitem(last=False)
            self.tokens -= tokens
            if link in self.added:
                self.added.discard(link)
            else:
                self.dropped.add(link)

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
