"""`--stream-interval` on the real engine: a worker that gathers 4 tokens per event streams the same greedy answer
as one that sends every token, its first token at once, then 4 at a time (the session's edge serves both: this
module's worker serves the default model under a name of its own)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import redis

from tests.processes import MODEL, Edge, WorkerProcess, running_worker

INTERVAL = 4
GATHERING = f"{MODEL}-every-{INTERVAL}"
TOKENS = 1 + 4 * INTERVAL + 2
"""The first token alone, four full events, then the last two (the stream's end is sent at once)."""


@pytest.fixture(scope="module")
def gathering(redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[WorkerProcess]:
    log: Path = tmp_path_factory.mktemp("gathering") / "worker.log"
    with running_worker(redis_url, redis_client, log, GATHERING, kv_cache_gib=1, max_num_seqs=4,
                        stream_interval=INTERVAL) as started:
        yield started


@pytest.fixture
async def sdk(served: Edge, gathering: WorkerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        yield client


async def _stream(sdk: openai.AsyncOpenAI, model: str) -> tuple[list[list[str]], int]:
    """The tokens of each content chunk (from their logprobs), and the usage's completion tokens."""
    chunks: list[list[str]] = []
    usage = 0
    stream = await sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=TOKENS,
        temperature=0, logprobs=True, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                chunks.append([entry.token for entry in choice.logprobs.content])
    return chunks, usage


def _ends(chunks: list[list[str]]) -> set[int]:
    """Where each chunk ends, in tokens from the start of the answer."""
    return set(itertools.accumulate(len(tokens) for tokens in chunks))


async def test_a_gathering_worker_streams_the_same_tokens_in_fewer_chunks(sdk: openai.AsyncOpenAI) -> None:
    every, every_usage = await _stream(sdk, MODEL)
    gathered, gathered_usage = await _stream(sdk, GATHERING)
    assert every_usage == gathered_usage == TOKENS
    assert list(itertools.chain(*gathered)) == list(itertools.chain(*every))
    # an edge that finds several events of a stream waiting sends them as one chunk, so chunks may join, but
    # never split: every chunk of the gathering worker ends where one of its events does
    assert {1, TOKENS} <= _ends(gathered) <= {1, *range(1 + INTERVAL, TOKENS, INTERVAL), TOKENS}
    assert len(_ends(every)) > len(_ends(gathered))
