"""tokenbus against `vllm serve` on the same model, engine settings and load, measured A B A B."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from services.bench import load, systems
from services.bench.workload import Distribution, requests

PROMPT_LEN = Distribution("uniform", 64, 192)
OUTPUT_LEN = Distribution("uniform", 64, 192)


@dataclass(frozen=True)
class Plan:
    concurrencies: tuple[int, ...] = (1, 8, 32)
    requests_per_stream: int = 3
    """Each level sends concurrency x this many requests (at least `min_requests`)."""
    min_requests: int = 6
    prompt_len: Distribution = PROMPT_LEN
    output_len: Distribution = OUTPUT_LEN
    rounds: int = 2
    api: str = "chat"


SystemFactory = Callable[[], AbstractContextManager[systems.Running]]


def _measure(
    name: str, running: systems.Running, engine: systems.Engine, plan: Plan, round_no: int
) -> list[load.Result]:
    warm = requests(4, Distribution("fixed", 16), Distribution("fixed", 8), seed=99)
    asyncio.run(load.run(load.Load(running.base_url, engine.model, plan.api, concurrency=4), warm,
                         system=f"{name} warm-up", quiet=True))
    results = []
    for concurrency in plan.concurrencies:
        count = max(plan.min_requests, concurrency * plan.requests_per_stream)
        # the same requests for both systems in the same round: same seed
        work = requests(count, plan.prompt_len, plan.output_len, seed=1000 * round_no + concurrency)
        shape = load.Load(running.base_url, engine.model, plan.api, concurrency=concurrency)
        result = asyncio.run(load.run(shape, work, system=name, seed=round_no))
        print(f"  {name} round {round_no} c={concurrency}: {result.output_throughput:.1f} tok/s, "
              f"TTFT p50 {result.ttft_ms.p50:.0f} ms, failed {result.failed}", file=sys.stderr)
        results.append(result)
    return results


def compare(engine: systems.Engine, plan: Plan, log_dir: Path) -> dict[str, list[list[load.Result]]]:
    """Runs tokenbus and vllm serve alternately, `plan.rounds` times each; every start is stopped again."""
    factories: dict[str, SystemFactory] = {
        "tokenbus": lambda: systems.tokenbus(engine, log_dir / "tokenbus.log"),
        "vllm serve": lambda: systems.vllm_serve(engine, log_dir / "vllm-serve.log"),
    }
    out: dict[str, list[list[load.Result]]] = {name: [] for name in factories}
    for round_no in range(plan.rounds):
        for name, factory in factories.items():
            print(f"round {round_no + 1}: starting {name}", file=sys.stderr)
            with factory() as running:
                out[name].append(_measure(name, running, engine, plan, round_no))
    return out


def vllm_bench_serve(engine: systems.Engine, log_dir: Path, prompts: int = 16) -> tuple[int, str]:
    """Points vLLM's own `vllm bench serve` at a tokenbus edge; returns its exit status and its summary."""
    with systems.tokenbus(engine, log_dir / "tokenbus-vllm-bench.log") as running:
        args = ["--backend", "openai", "--base-url", running.base_url, "--endpoint", "/v1/completions",
                "--model", engine.model, "--tokenizer", str(engine.model_dir), "--dataset-name", "random",
                "--random-input-len", "64", "--random-output-len", "32", "--num-prompts", str(prompts),
                "--max-concurrency", "4", "--ignore-eos"]
        done = subprocess.run([sys.executable, "-m", "services.bench.vllm_bench", *args],
                              capture_output=True, text=True, timeout=600)
    return done.returncode, result_block(done.stdout + done.stderr)


def result_block(text: str) -> str:
    """The summary table `vllm bench serve` prints, without the progress bars and warnings around it."""
    start = text.find("============ Serving Benchmark Result ============")
    if start < 0:
        return text[-3000:]
    end = text.find("=" * 50, start + 50)
    return text[start:] if end < 0 else text[start:end + 50]
