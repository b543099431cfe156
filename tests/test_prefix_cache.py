"""Prompt prefixes as a prefix cache names them (chained block hashes), the LRU cache of the simulated engine, and
that engine's prefills: a prompt whose leading blocks it holds costs only the rest (the tool `tokenbus bench`
measures cache-aware dispatch with)."""

from __future__ import annotations

import time

import httpx
import openai

from services.worker.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes
from tests.processes import metric_value
from tests.stack import Stack


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
