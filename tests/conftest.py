"""One private Redis, the real vLLM workers and one edge per test session, started as real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import redis

from services.supervisor import private_redis
from tests.made_models import make_adapter, make_cross_encoder
from tests.processes import (
    EMBEDDING_MODEL,
    GATHERING_MODEL,
    MODEL,
    STREAM_INTERVAL,
    Edge,
    WorkerProcess,
    lost_its_port,
    spawn_worker,
    start_edge,
    started_worker,
    stop_process,
    wait_serving,
)
from tests.stack import Stack

ENGINE_MODULES = frozenset(f"tests/test_{name}.py" for name in (
    "adapters", "chat_engine", "chat_extras", "completions", "embeddings", "messages", "migration_engine",
    "reasoning_engine", "rerank", "responses", "routes", "seed_conformance", "service", "sse_clients",
    "stream_interval", "structured", "tgi", "tools_engine", "workers"))
"""The modules with tests of the session's real workers: `make test` runs them all in one process."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test of the real workers in a module not named in ENGINE_MODULES would start a second set of them in
    another process: refused at collection, naming the module."""
    module = item.nodeid.split("::")[0]
    if "real_workers" in getattr(item, "fixturenames", ()) and module not in ENGINE_MODULES:
        raise pytest.UsageError(f"{module} uses the real workers: add it to tests/conftest.py's ENGINE_MODULES")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs the suite in two processes (pytest-xdist, `-n 2`): every module of ENGINE_MODULES in one,
    as they share the session's real workers (started once, in that process only), and each other module whole
    (its module fixtures made once) in either."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return "engines" if module in ENGINE_MODULES else module

    return ByModule(config, log)


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


SCORING_MODEL = "minilm-cross-encoder"
"""The cross-encoder the session's `scorer` serves (tests.made_models.make_cross_encoder)."""
STATIC_ADAPTER = "smollm2-started-with"
"""The LoRA adapter the default model's worker is started with (--lora; test_adapters adds others at run time)."""

REAL_WORKERS: dict[str, tuple[str, dict[str, object]]] = {
    # with a reasoning parser: SmolLM2 never opens a <think> block by itself, so its answers are as without one,
    # and test_reasoning_engine makes it write one; serving adapters (--lora is added at start, see real_workers)
    "worker": (MODEL, {"kv_cache_gib": 2, "reasoning_parser": "qwen3", "enable_lora": True}),
    "embedder": (EMBEDDING_MODEL, {"kv_cache_gib": 1, "task": "embed"}),
    # its first constrained request is test_structured's (the backend test needs it: send it no other constraint)
    "gathering_worker": (GATHERING_MODEL, {"kv_cache_gib": 1, "max_num_seqs": 4, "stream_interval": STREAM_INTERVAL}),
    "scorer": (SCORING_MODEL, {"kv_cache_gib": 1, "task": "score"}),  # its --model-dir is made at start
}
"""The real vLLM workers of a session, by fixture name: the model each serves and its settings."""


@pytest.fixture(scope="session")
def real_workers(request: pytest.FixtureRequest, redis_url: str, redis_client: redis.Redis,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    """Every real worker the session's tests use, started side by side when the first is needed and stopped at the
    session's end: an engine's start is mostly one core importing vLLM in three processes in turn, so on two cores
    three starts together take about as long as two one after the other."""
    needed = [name for name in REAL_WORKERS if any(name in item.fixturenames for item in request.session.items)]
    started: dict[str, WorkerProcess] = {}
    spawned: dict[str, dict[str, object]] = {}
    try:
        for name in needed or REAL_WORKERS:
            model, settings = REAL_WORKERS[name]
            if name == "worker":
                static = make_adapter(tmp_path_factory.mktemp("adapters") / STATIC_ADAPTER, seed=3)
                settings = {**settings, "lora": f"{STATIC_ADAPTER}={static}"}
            if name == "scorer":
                settings = {**settings, "model_dir": make_cross_encoder(scoring_model_dir(tmp_path_factory))}
            spawned[name] = settings
            started[name] = spawn_worker(redis_url, tmp_path_factory.mktemp(name) / "worker.log", model, **settings)
        for name, running in started.items():
            model = REAL_WORKERS[name][0]
            try:
                wait_serving(running, redis_client, model)
            except RuntimeError:
                if not lost_its_port(running.process, running.log):
                    raise
                stop_process(running.process)  # once more, alone, on other ports
                started[name] = started_worker(redis_url, redis_client, running.log, model, **spawned[name])
        yield started
    finally:
        for running in started.values():
            stop_process(running.process)


@pytest.fixture(scope="session")
def worker(real_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    """The real vLLM worker on the default model."""
    return real_workers["worker"]


@pytest.fixture(scope="session")
def embedder(real_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    """A real vLLM worker in pooling mode on all-MiniLM-L6-v2."""
    return real_workers["embedder"]


@pytest.fixture(scope="session")
def gathering_worker(real_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    """A real vLLM worker on the default model as GATHERING_MODEL, sending STREAM_INTERVAL tokens per event."""
    return real_workers["gathering_worker"]


def scoring_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's cross-encoder lies (made once)."""
    return tmp_path_factory.getbasetemp() / "cross-encoder"


@pytest.fixture(scope="session")
def scorer(real_workers: dict[str, WorkerProcess]) -> WorkerProcess:
    """A real vLLM worker serving a cross-encoder (the score task) as SCORING_MODEL."""
    return real_workers["scorer"]


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
