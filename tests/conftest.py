"""One private Redis, one real vLLM worker and one edge per test session, started as real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import redis

from services.supervisor import private_redis
from tests.processes import EMBEDDING_MODEL, MODEL, Edge, WorkerProcess, running_worker, start_edge, stop_process
from tests.stack import Stack


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with private_redis() as url:
        yield url


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def edge(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    # no resume window: a client that leaves has its engine request aborted at once (tested)
    started = start_edge(redis_url, tmp_path_factory.mktemp("edge"), resume_window_s=0)
    yield started
    stop_process(started.process)


@pytest.fixture(scope="session")
def worker(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """The real vLLM worker on the default model, started once (with a reasoning parser: SmolLM2 never opens
    a <think> block by itself, so its answers are as without one, and test_reasoning_engine makes it write one)."""
    with running_worker(redis_url, redis_client, tmp_path_factory.mktemp("worker") / "worker.log", MODEL,
                        kv_cache_gib=2, reasoning_parser="qwen3") as started:
        yield started


@pytest.fixture(scope="session")
def embedder(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A real vLLM worker in pooling mode on all-MiniLM-L6-v2, started once."""
    with running_worker(redis_url, redis_client, tmp_path_factory.mktemp("embedder") / "worker.log",
                        EMBEDDING_MODEL, kv_cache_gib=1, task="embed") as started:
        yield started


@pytest.fixture(scope="session")
def served(worker: WorkerProcess, edge: Edge) -> Edge:
    """The edge, once the worker has answered one request (the engine's first request is slow)."""
    with openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4)
    return edge


@pytest.fixture
async def client(served: Edge) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                  timeout=60) as client:
        yield client


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """A stack of separate processes of the test's own (fault and deployment tests): see tests/stack.py. Its
    Redis is reached over TCP, or over a Unix socket where a test is parametrized with "unix"."""
    with Stack(tmp_path, unix_socket=getattr(request, "param", "tcp") == "unix") as running:
        yield running
