"""A simulated engine, for benchmarking the edge and the bus and for fault tests: never for serving.

It behaves like a continuously batching engine with fixed timings: each request waits `ttft` (its
prefill), then joins the running batch, which produces one token for every running request per step of
`itl`. With a prefill cost per prompt token, prompts also pass one by one through a prefill lane, the most
urgent (the lowest priority value) first; with a prefix cache, only the tokens past the leading blocks it holds.
Its text is a counting placeholder, not language: token n of a choice is " t{n}", so a client can check that a
stream that moved between workers lost and repeated nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Protocol

from services.worker.engine_feed import JobFeed, Take
from services.worker.loras import Loras, LoraSettings
from services.worker.prefill import PrefillLane
from services.worker.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes
from shared.protocol import bus
from shared.protocol.errors import AdapterUnavailable
from shared.runtime import metrics
from shared.runtime.settings import SlotSettings, engine_seqs

log = logging.getLogger(__name__)


class SimSettings(SlotSettings, LoraSettings, Protocol):
    """The settings the simulated engine reads (Settings has them)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def sim_itl_ms(self) -> float: ...
    @property
    def sim_prefill_us_per_token(self) -> float: ...
    @property
    def sim_ttft_ms(self) -> float: ...
    @property
    def sim_prefix_cache_blocks(self) -> int: ...
    @property
    def sim_dies_after_tokens(self) -> int: ...


DEFAULT_MAX_TOKENS = 128
SPIN_S = 0.0015
"""The last stretch of a prefill is waited out by yielding to the loop rather than by a timer: asyncio's
timers wake on the millisecond grain of epoll, on average half a millisecond late, and that lateness would
be counted as the bus's."""


async def _sleep_until(deadline: float) -> None:
    """Precise to a loop iteration, at the price of a little CPU in the last SPIN_S."""
    await asyncio.sleep(max(0.0, deadline - SPIN_S - time.monotonic()))
    while time.monotonic() < deadline:  # noqa: ASYNC110 - a spin on purpose: no event marks a moment
        await asyncio.sleep(0)


def token(job: bus.Job, choice: int, n: int, finish: str | None) -> bus.Tokens:
    """Token n (from 1) of a choice."""
    return bus.Tokens(job=job.id, text=f" t{n}", token_ids=[n % 1000], choice=choice, finish_reason=finish)


@dataclass
class _Sequence:
    job: bus.Job
    choice: int
    left: int
    produced: int = 0
    feed: JobFeed | None = None
    """Where its tokens go as each step makes them (set once the job's sequences are known)."""

    def give(self, finish: str | None) -> None:
        """Its latest token, to its job."""
        assert self.feed is not None  # nosec B101: an invariant (tokenbus never runs with -O)
        self.feed.give([token(self.job, self.choice, self.produced, finish)], finished=finish is not None)


class SimEngineDead(Exception):
    """What the simulated engine raises once it died, as vLLM's EngineDeadError."""


class SimEngine:
    """Engine protocol over a timer instead of a model."""

    def __init__(self, settings: SimSettings) -> None:
        self.ttft_s = settings.sim_ttft_ms / 1000
        self.itl_s = settings.sim_itl_ms / 1000
        self.max_model_len = settings.max_model_len
        self.cache_tokens = settings.sim_prefix_cache_blocks * BLOCK_TOKENS
        self.dimensions = 0
        self.loras = Loras.of(settings)
        self.max_loras = settings.max_loras if self.loras.enabled else 0
        """With --enable-lora it takes adapters' jobs (their answers are as the base model's: it has no weights),
        holding the last --max-loras it ran: what placement tests watch."""
        self.held: dict[str, None] = {}
        self.running: list[_Sequence] = []
        self.slots = engine_seqs(settings)
        self.gauges = (metrics.ENGINE_RUNNING.labels(settings.model), metrics.KV_CACHE_USAGE.labels(settings.model))
        """Running sequences, and the share of the slots they fill (the simulated engine's cache); nothing waits
        in the simulated engine (the worker never gives it more than its slots)."""
        self.live: set[str] = set()
        """Jobs it runs now (an abort of another is a no-op, as vLLM's of an unknown request)."""
        self.aborted: set[str] = set()
        self.stepper: asyncio.Task[None] | None = None
        self.prefills = PrefillLane(settings.sim_prefill_us_per_token / 1e6)
        self.cache = PrefixCache(settings.sim_prefix_cache_blocks)
        self.cache_counters = (metrics.PREFIX_CACHE_QUERIES.labels(settings.model),
                               metrics.PREFIX_CACHE_HITS.labels(settings.model))
        self.tokens_to_death = settings.sim_dies_after_tokens or -1
        """Tokens it makes before it dies (-1: it never does)."""

    def start(self) -> None:
        """Nothing to load."""

    async def prepare(self) -> None:
        """No adapters to load."""

    def static_adapters(self) -> list[str]:
        return sorted(self.loras.modules)

    def held_adapters(self) -> list[str]:
        return sorted(self.held)

    def _hold(self, job: bus.Job) -> None:
        """The job's adapter is the one held longest from now (the oldest past --max-loras is let go)."""
        if not job.adapter:
            return
        if not self.max_loras:
            raise AdapterUnavailable(f"The workers of `{job.model}` serve no adapters.", param="model")
        self.held.pop(job.adapter, None)
        self.held[job.adapter] = None
        while len(self.held) > self.max_loras:
            del self.held[next(iter(self.held))]

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self.stepper is not None:
            self.stepper.cancel()
        self.prefills.stop()

    async def _step(self) -> None:
        """One token for every running sequence per step, like a batching engine."""
        next_step = time.monotonic()
        while self.running:
            next_step += self.itl_s
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))
            if self._dies_in(len(self.running)):
                return
            going_on = []  # one pass: a step where many finish costs no list.remove each
            for seq in self.running:
                aborted = seq.job.id in self.aborted
                seq.left -= 1
                seq.produced += 1
                finish = "abort" if aborted else ("length" if seq.left <= 0 else None)
                seq.give(finish)
                if finish is None:
                    going_on.append(seq)
            self.running = going_on
            self._gauge()
        self.stepper = None

    def _dies_in(self, tokens: int) -> bool:
        """Whether it dies within this step's `tokens` (--sim-dies-after-tokens): it fails every sequence then."""
        if self.tokens_to_death < 0:
            return False
        was = self.tokens_to_death
        self.tokens_to_death = max(0, was - tokens)
        if self.tokens_to_death:
            return False
        if was:
            log.error("the simulated engine died (--sim-dies-after-tokens)")
        for seq in self.running:
            if seq.feed is not None:
                seq.feed.fail(SimEngineDead())
        self.running, self.stepper = [], None
        self._gauge()
        return True

    def dead(self) -> bool:
        return self.tokens_to_death == 0

    def _join_batch(self) -> None:
        self._gauge()
        if self.stepper is None and self.running:
            self.stepper = asyncio.create_task(self._step())

    def _gauge(self) -> None:
        running, usage = self.gauges
        running.set(len(self.running))
        usage.set(min(1.0, len(self.running) / max(1, self.slots)))

    async def run_into(self, job: bus.Job, priority: int, take: Take) -> None:
        """Hands the job's tokens to `take` as each step makes them (services.worker.engine_feed), then its Final."""
        if self.dead():
            raise SimEngineDead()
        self._hold(job)
        self.live.add(job.id)
        try:
            await self._run_into(job, priority, take)
        finally:
            self.live.discard(job.id)
            self.aborted.discard(job.id)

    async def _run_into(self, job: bus.Job, priority: int, take: Take) -> None:
        prompts = len(job.prompts) or 1
        prompt_tokens, dropped = self._prompt(job)
        if job.count_only:
            if job.tokens_out:
                take(self._tokens_out(job))
            take(bus.Final(job=job.id, prompt_tokens=prompt_tokens, completion_tokens=0))
            return
        hashes = block_hashes(self._words(job, dropped), salt=job.cache_salt) if self.cache.capacity else []
        cached = self.cache.held(hashes) * BLOCK_TOKENS
        queries, hits = self.cache_counters
        queries.inc(prompt_tokens)
        hits.inc(cached)
        await self.prefills.prefill(prompt_tokens - cached, priority)
        self.cache.keep(hashes)
        deadline = time.monotonic() + self.ttft_s
        sequences = self._sequences(job, prompts * job.params.n)  # made before the prefill's end, not after it
        carried = sum(seq.produced - 1 for seq in sequences)
        feed, finished = JobFeed(take, len(sequences)), False
        await _sleep_until(deadline)  # prefill, which gives each sequence's first token
        for seq in sequences:
            seq.feed = feed
            seq.give("length" if seq.left <= 0 else None)
        self.running.extend(seq for seq in sequences if seq.left > 0)
        self._join_batch()
        try:
            await feed.wait()
            finished = True
        finally:
            if not finished:  # its take failed, or its run was cancelled: its sequences stop
                feed.close()
                self.running = [seq for seq in self.running if seq.feed is not feed]
        take(bus.Final(job=job.id, prompt_tokens=prompt_tokens,
                       completion_tokens=sum(seq.produced for seq in sequences) - carried, dropped_messages=dropped))

    @staticmethod
    def _tokens_out(job: bus.Job) -> bus.Prompt:
        """The simulated tokenizer's answer: a token a word (its id its position), an id list read back as words."""
        if job.prompt_ids:
            ids = job.prompt_ids[0]
            return bus.Prompt(job=job.id, index=0, token_ids=ids, token_strs=[f"t{i}" for i in ids],
                              text=" ".join(f"t{i}" for i in ids))
        text = job.prompts[0] if job.prompts else " ".join(m.content for m in job.messages)
        words = [(word.start(), word.end()) for word in re.finditer(r"\S+", text)]
        return bus.Prompt(job=job.id, index=0, token_ids=list(range(len(words))),
                          token_strs=[text[a:b] for a, b in words], spans=words if job.prompts else [])

    def _prompt(self, job: bus.Job) -> tuple[int, int]:
        """Prompt tokens (a word each) and the messages truncation "auto" drops as the engine does: the oldest
        non-system ones, never the last, until the prompt and the token budget fit the context."""
        if job.prompt_ids:
            return sum(map(len, job.prompt_ids)), 0
        if job.prompts:
            return sum(len(p.split()) for p in job.prompts), 0
        sizes = [(m.role == "system", len(m.content.split())) for m in job.messages]
        total, dropped = sum(n for _, n in sizes), 0
        droppable = [n for system, n in sizes if not system][:-1]
        budget = self.max_model_len - max(job.params.max_tokens or 0, 1)
        while job.truncate and total > budget and dropped < len(droppable):
            total -= droppable[dropped]
            dropped += 1
        return total, dropped

    @staticmethod
    def _words(job: bus.Job, dropped: int) -> list[str]:
        """The prompt's words in order (the first prompt's, for several), as the cache names its blocks: each
        message's role, then its words, without the messages truncation dropped."""
        if job.prompt_ids:
            return [str(token) for token in job.prompt_ids[0]]
        if job.prompts:
            return job.prompts[0].split()
        kept = [m for m in job.messages if m.role == "system"] + [m for m in job.messages if m.role != "system"][
            dropped:]
        kept.sort(key=job.messages.index)
        return [word for message in kept for word in (f"<{message.role}>", *message.content.split())]

    @staticmethod
    def _sequences(job: bus.Job, choices: int) -> list[_Sequence]:
        """A sequence per unfinished choice; one that continues another worker's starts after its tokens."""
        want = job.params.max_tokens or DEFAULT_MAX_TOKENS
        cont = job.continuation
        sequences = []
        for c in range(choices):
            had = len(cont.token_ids[c]) if cont and c < len(cont.token_ids) else 0
            if not (cont and c < len(cont.finished) and cont.finished[c]):
                sequences.append(_Sequence(job=job, choice=c, left=want - had - 1, produced=had + 1))
        return sequences

    async def abort(self, job_id: str) -> None:
        if job_id in self.live:  # an abort after its end (a stopped job's second) leaves nothing behind
            self.aborted.add(job_id)

    @staticmethod
    def decode(job: bus.Job, token_ids: list[int]) -> str:
        """Token n's text is " t{n}" and its id n % 1000: exact for the first thousand tokens of a choice."""
        return "".join(f" t{n}" for n in range(1, len(token_ids) + 1))
