"""Prompt prefixes as a prefix cache names them (chained block hashes), the LRU cache of the simulated engine, and
that engine's prefills: a prompt whose leading blocks it holds costs only the rest (the tool `tokenbus bench`
measures cache-aware dispatch with); and the prefixes each worker reports holding, for placement."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from services.worker.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes
from services.worker.prefix_summary import PrefixSummary
from shared.protocol import bus, keys, prefixes
from tests.processes import metric_value, stop_process
from tests.stack import Stack
from tests.test_tenancy import create_key


def test_two_prompts_share_exactly_the_blocks_of_their_common_start() -> None:
    shared = [f"w{i}" for i in range(40)]
    one, other = block_hashes([*shared, "a", *shared]), block_hashes([*shared, "b", *shared])
    assert len(one) == len(other) == (2 * 40 + 1) // BLOCK_TOKENS
    assert one[:2] == other[:2]  # the first 32 words are the same
    assert all(a != b for a, b in zip(one[2:], other[2:], strict=True))  # a block after a difference never is
    assert block_hashes(shared[:BLOCK_TOKENS - 1]) == []  # no full block


def test_the_cache_counts_only_leading_blocks_and_evicts_the_least_recently_used() -> None:
    cache = PrefixCache(capacity=4)
    first, second = block_hashes([f"a{i}" for i in range(48)]), block_hashes([f"b{i}" for i in range(32)])
    assert cache.held(first) == 0
    cache.keep(first)
    assert cache.held(first) == 3
    assert cache.held(block_hashes(["other", *[f"a{i}" for i in range(1, 48)]])) == 0  # the same words after another
    cache.keep(second)  # 5 blocks for 4 places: first's least recently used goes
    assert cache.held(second) == 2 and cache.held(first) == 0
    assert cache.hit_rate == (3 + 2) / (3 + 3 + 3 + 2 + 3)


async def test_a_simulated_prefill_costs_only_what_the_cache_does_not_hold(stack: Stack) -> None:
    edge = stack.edge()
    worker = stack.worker(sim_ttft_ms=10, sim_prefill_us_per_token=2000, sim_prefix_cache_blocks=1000)
    system = " ".join(f"rule {i}." for i in range(400))  # 800 words: 1.6 s of prefill
    waits = []
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        for question in ("first question", "second question"):
            sent = time.monotonic()
            await client.chat.completions.create(model=stack.model, max_tokens=1, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
            waits.append(time.monotonic() - sent)
    assert waits[0] > 1.5 and waits[1] < 0.6, waits  # the second prefills only its last block and question
    async with httpx.AsyncClient() as http:
        text = (await http.get(worker.metrics_url)).text
    queried = metric_value(text, "tokenbus_worker_prefix_cache_queries_total", {"model": stack.model})
    hit = metric_value(text, "tokenbus_worker_prefix_cache_hits_total", {"model": stack.model})
    assert queried == 2 * 802 and hit == 800, (queried, hit)  # 802 prompt words; the blocks held: 50


@pytest.mark.parametrize("prompt_cache", ["tenant", "shared"])
async def test_one_tenant_finds_nothing_of_another_s_prompts_in_the_cache_unless_it_is_shared(
    stack: Stack, prompt_cache: str
) -> None:
    """A cached prompt answers sooner: a tenant that sends another's prompt (a guess at a secret in it) must find
    nothing cached, or it learns by timing what the other sent; its own prompts it finds."""
    edge = stack.edge(auth="keys", prompt_cache=prompt_cache)
    worker = stack.worker(sim_ttft_ms=5, sim_prefill_us_per_token=100, sim_prefix_cache_blocks=1000)
    owner, prober = create_key(stack, "--tenant", "owner"), create_key(stack, "--tenant", "prober")
    system = "The customer's PIN is 4711. " + " ".join(f"rule {i}." for i in range(200))  # 406 words, 25 blocks

    async def hits_after(key: dict[str, Any]) -> float:
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=key["key"], max_retries=0) as client:
            await client.chat.completions.create(model=stack.model, max_tokens=1, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
        async with httpx.AsyncClient() as http:
            text = (await http.get(worker.metrics_url)).text
        return metric_value(text, "tokenbus_worker_prefix_cache_hits_total", {"model": stack.model})

    assert await hits_after(owner) == 0
    probed = await hits_after(prober)
    assert probed == (400 if prompt_cache == "shared" else 0)
    assert await hits_after(owner) == probed + 400  # its own prompt's 25 full blocks


def _job(job_id: str, text: str, tokens: int) -> bus.Job:
    """A chat job of one message: `text` of 1 KiB pieces is a chain of as many links, `tokens` its estimate."""
    job = bus.Job(id=job_id, model="m", reply_to="", deadline_ms=0, messages=[bus.Message(role="user", content=text)])
    job.prompt_estimate = tokens
    return job


def _written(summary: PrefixSummary, in_redis: set[str]) -> set[str]:
    """What the set in Redis holds after the summary's next write went through."""
    commands, changes = summary.commands()
    for command in commands:
        if command[0] == "SADD":
            in_redis |= {str(link) for link in command[2:]}
        elif command[0] == "SREM":
            in_redis -= {str(link) for link in command[2:]}
    summary.written(changes, [1] * len(commands))
    return in_redis


def test_a_summary_shows_a_job_s_links_from_its_start_and_holds_them_only_once_prefilled() -> None:
    """A cache of 300 tokens holding two prompts of 100 (one link each): ten jobs queued behind them show their links
    at once (so that their prefix follows them) yet evict nothing the engine holds; once one is prefilled it takes
    its place, evicting the least recently used; a job that ends before its prefill takes its links out again."""
    summary = PrefixSummary("m", "w", max_links=64, ttl_ms=1000, cache_tokens=300)
    held = [_job(f"h{n}", f"held {n}", 100) for n in range(2)]
    for job in held:
        summary.started(job)
        summary.prefilled(job.id)
        summary.ended(job.id, 100)
    in_redis = _written(summary, set())
    old = {link for job in held for link in prefixes.chain(job)}
    assert in_redis == old
    queued = [_job(f"q{n}", f"queued {n}", 100) for n in range(10)]
    assert all(summary.started(job) for job in queued)
    in_redis = _written(summary, in_redis)
    new = [prefixes.chain(job)[0] for job in queued]
    assert in_redis == old | set(new)  # ten jobs' worth (1,000 tokens) queued: the held ones stay
    assert not summary.prefilled("q0")  # already in the set, and 300 tokens fit
    assert summary.prefilled("q1")  # 400 tokens prefilled in a cache of 300: the oldest goes
    in_redis = _written(summary, in_redis)
    assert prefixes.chain(held[0])[0] not in in_redis and prefixes.chain(held[1])[0] in in_redis
    summary.ended("q0", 100)
    assert summary.ended("q9")  # it never reached its prefill
    assert _written(summary, in_redis) == (old | set(new)) - {prefixes.chain(held[0])[0], new[9]}


def test_a_link_a_waiting_job_shares_stays_in_the_set_when_its_holder_evicts_it() -> None:
    """Two jobs of one prompt: the first prefilled, then evicted by others, while the second still waits for its
    prefill: the link stays in the set (the second job will hold it), and leaves it if that job ends unprefilled."""
    summary = PrefixSummary("m", "w", max_links=2, ttl_ms=1000)
    first, second = _job("a", "shared", 10), _job("b", "shared", 10)
    summary.started(first)
    summary.prefilled(first.id)
    summary.started(second)
    for n in range(3):
        other = _job(f"o{n}", f"other {n}", 10)
        summary.started(other)
        summary.prefilled(other.id)
    link = prefixes.chain(first)[0]
    assert link not in summary.links
    assert link in _written(summary, set())
    summary.ended(second.id)
    assert link not in _written(summary, {link})


def _sets(stack: Stack) -> dict[str, set[str]]:
    """Each worker's reported prefixes, by its set's key."""
    return {key.decode(): {link.decode() for link in stack.client.smembers(key)}
            for key in stack.client.scan_iter(keys.prefixes(stack.model, "*"))}


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_a_worker_reports_the_prefixes_it_ran_and_they_go_with_it(stack: Stack) -> None:
    """After a conversation's two turns, the worker's set holds the chain of each (the second extends the first),
    the least recently used dropped past its size; a stopped worker's set goes at once, a killed one's with its
    heartbeat."""
    edge = stack.edge()
    stack.worker(prefix_summary_size=4)
    turns = [[bus.Message(role="system", content="You are terse."), bus.Message(role="user", content="Hi")]]
    turns.append([*turns[0], bus.Message(role="assistant", content=" t1"), bus.Message(role="user", content="Bye")])
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        for messages in turns:
            await client.chat.completions.create(model=stack.model, max_tokens=1, messages=[
                {"role": m.role, "content": m.content} for m in messages])  # type: ignore[misc]
    chains = [prefixes.chain(bus.Job(id="j", model=stack.model, reply_to="", deadline_ms=0, messages=messages))
              for messages in turns]
    assert chains[1][:2] == chains[0] and len(chains[1]) == 4
    await _until(lambda: list(_sets(stack).values()) == [set(chains[1])])  # 4 places: the first turn's are in it
    stack.worker(prefix_summary_size=4)
    stopping = stack.workers[0]
    stack.workers.remove(stopping)
    stop_process(stopping.process)
    assert list(_sets(stack).values()) == []  # the other one ran nothing
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        await client.chat.completions.create(model=stack.model, max_tokens=1, messages=[
            {"role": m.role, "content": m.content} for m in turns[0]])  # type: ignore[misc]
    await _until(lambda: list(_sets(stack).values()) == [set(chains[0])])
    stack.kill(stack.workers[0].process)
    await _until(lambda: _sets(stack) == {})  # its heartbeat's TTL (2 s here)
