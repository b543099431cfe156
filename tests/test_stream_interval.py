"""`--stream-interval` on the real engine: a worker that gathers 4 tokens per event streams the same greedy answer
as one that sends every token, its first token at once, then 4 at a time (the session's edge serves both: the
gathering worker serves the default model under a name of its own)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import openai
import pytest

from tests.processes import GATHERING_MODEL, MODEL, STREAM_INTERVAL, Edge, WorkerProcess

TOKENS = 1 + 4 * STREAM_INTERVAL + 2
"""The first token alone, four full events, then the last two (the stream's end is sent at once)."""


@pytest.fixture
async def sdk(served: Edge, gathering_worker: WorkerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
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
    gathered, gathered_usage = await _stream(sdk, GATHERING_MODEL)
    assert every_usage == gathered_usage == TOKENS
    assert list(itertools.chain(*gathered)) == list(itertools.chain(*every))
    # an edge that finds several events of a stream waiting sends them as one chunk, so chunks may join, but
    # never split: every chunk of the gathering worker ends where one of its events does
    assert {1, TOKENS} <= _ends(gathered) <= {1, *range(1 + STREAM_INTERVAL, TOKENS, STREAM_INTERVAL), TOKENS}
    assert len(_ends(every)) > len(_ends(gathered))
