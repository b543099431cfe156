"""What a worker's engine holds, as placement sees it: the prefix chains (shared.protocol.prefixes) of the jobs it
prefilled, least recently used dropped first past its capacity, and those of the jobs waiting for their prefill here,
kept in Redis as a set of its own (keys.prefixes), changed by what changed since the last write that went through:
as a job starts and as its prefill ends (in the publisher's next write, so that dispatch sees it for the very next
job) and with each heartbeat (which retries what failed); it expires with the heartbeat (a dead worker's set goes by
itself)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from shared.protocol import bus, keys, prefixes
from shared.redisio.rawpipe import Arg, PipelineLike

Changes = tuple[set[str], set[str]]
"""Links added and dropped, as one write sent them."""


@dataclass
class _Job:
    """A job started here, as the summary keeps it until it ends."""

    chain: list[str]
    prompt_tokens: int
    """The edge's estimate (the engine counts at the end)."""
    prefilled: bool = False


class PrefixSummary:
    """`max_links` bounds the links held; `cache_tokens` (0: unknown) the prompt tokens they stand for, as the
    engine's KV cache bounds what it holds: a link stands for its job's prompt tokens over its links (the edge's
    estimate at the prefill, the engine's count once the job ends), so the summary forgets about when the engine
    evicts.

    A job's links are in the set from its start, so that dispatch sends the same prefix here while this worker
    prefills it, but they count as held (take a place, evict others) only once the engine prefilled them, as the
    engine allocates its cache: jobs waiting for the prefill evict nothing it holds."""

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
        self.pending: Counter[str] = Counter()
        """Links of the jobs started and not yet prefilled here, by how many of them: in the set, not held."""
        self.jobs: dict[str, _Job] = {}
        """The jobs started and not yet ended here."""
        self.added: set[str] = set()
        """In the set, not yet written."""
        self.dropped: set[str] = set()
        """Out of the set, not yet removed."""

    def started(self, job: bus.Job) -> bool:
        """The job reached the engine: its links go into the set, pending its prefill. True if that changed the
        set."""
        if self.max_links <= 0 or not (chain := prefixes.chain(job)):
            return False
        self.ended(job.id)
        self.jobs[job.id] = _Job(chain, job.prompt_estimate)
        for link in chain:
            if link not in self.links and link not in self.pending:
                self._show(link)
            self.pending[link] += 1
        return self.changed

    def prefilled(self, job_id: str) -> bool:
        """The engine prefilled the job's prompt (its first output came): its links are held, the most recently
        used. True if that changed the set."""
        job = self.jobs.get(job_id)
        if job is None or job.prefilled:
            return False
        job.prefilled = True
        for link in job.chain:
            self._weigh(link, max(1, job.prompt_tokens // len(job.chain)))
            self.links.move_to_end(link)
        self._unpend(job.chain)
        self._evict()
        return self.changed

    def ended(self, job_id: str, prompt_tokens: int = 0) -> bool:
        """The job ended here: its links held stand for the engine's count of its prompt (if it counted one); if it
        never reached its prefill, links nothing else holds or waits for leave the set. True if the set changed."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return False
        if not job.prefilled:
            self._unpend(job.chain)
        elif prompt_tokens:
            for link in job.chain:
                if link in self.links:
                    self._weigh(link, max(1, prompt_tokens // len(job.chain)))
            self._evict()
        return self.changed

    @property
    def changed(self) -> bool:
        """Whether the set has changes not yet written."""
        return bool(self.added or self.dropped)

    def _unpend(self, chain: list[str]) -> None:
        for link in chain:
            self.pending[link] -= 1
            if self.pending[link] <= 0:
                del self.pending[link]
                if link not in self.links:
                    self._hide(link)

    def _show(self, link: str) -> None:
        if link in self.dropped:
            self.dropped.discard(link)
        else:
            self.added.add(link)

    def _hide(self, link: str) -> None:
        if link in self.added:
            self.added.discard(link)
        else:
            self.dropped.add(link)

    def _weigh(self, link: str, tokens: int) -> None:
        self.tokens += tokens - self.links.get(link, 0)
        self.links[link] = tokens

    def _evict(self) -> None:
        while len(self.links) > self.max_links or (self.cache_tokens and self.tokens > self.cache_tokens
                                                   and len(self.links) > 1):
            link, tokens = self.links.popitem(last=False)
            self.tokens -= tokens
            if link not in self.pending:
                self._hide(link)

    def commands(self) -> tuple[list[tuple[Arg, ...]], Changes]:
        """The writes of the changes and the set's renewed expiry, and the changes, for `written` once they went
        through."""
        added, dropped = set(self.added), set(self.dropped)
        commands: list[tuple[Arg, ...]] = []
        if added:
            commands.append(("SADD", self.key, *sorted(added)))
        if dropped:
            commands.append(("SREM", self.key, *sorted(dropped)))
        if self.links or self.pending:
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
        self.added, self.dropped = set(self.links) | set(self.pending), set()

    def forget(self, pipe: PipelineLike) -> None:
        """Removes the set (the worker stops)."""
        pipe.execute_command("DEL", self.key)
