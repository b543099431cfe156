"""What the hop through Redis costs per token against the streaming layer it has to beat: tokenbus (one edge) and
`vllm serve` up at once, the long c=8 cell of `bench compare` (8 chat requests, prompts of 64-192 words, 64-192
output tokens, greedy, ignore_eos), each system asked twice per round: streamed, and for the whole answer at once
(`"stream": false`). Rounds alternate the systems' order; the requests are the same for both in a round.

vllm serve's API server streamed less the same server answering whole is what its per-token streaming layer costs
(the chunk objects, their JSON, the HTTP writes): the budget that tokenbus's edge, the worker's publishing and
Redis share if tokenbus is to spend no more front-end CPU per token than vllm serve. The worker answering whole
still publishes every step's events (the edge gathers them), so its figure is its AsyncLLM work plus its
publishing; against vllm serve answering whole (its AsyncLLM work plus one HTTP answer per request) it shows what
publishing costs the worker.

    .venv/bin/python docs/bench36/cpu_floor.py ROUNDS out.json
"""
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import orjson

from services.bench import client, compare, systems
from services.bench.cli import _engine
from services.bench.stats import paired_bootstrap_ratio
from services.bench.workload import requests

SHAPE = compare.long_shape(8, 8)


async def _ask(base_url: str, model: str, work: list, stream: bool) -> int:
    """Sends the requests at once; the completion tokens they got."""
    async def one(session: aiohttp.ClientSession, request) -> int:
        body = client.body_for("chat", model, request)
        if not stream:
            body["stream"] = False
            del body["stream_options"]
        async with session.post(base_url + "/v1/chat/completions", data=orjson.dumps(body), headers=client.JSON,
                                timeout=aiohttp.ClientTimeout(total=600)) as reply:
            if not stream:
                return int((await reply.json())["usage"]["completion_tokens"])
            tokens = 0
            async for line in reply.content:
                if line.startswith(b"data: {"):
                    usage = orjson.loads(line[6:]).get("usage") or {}
                    tokens = usage.get("completion_tokens", tokens)
            return tokens

    async with aiohttp.ClientSession() as session:
        return sum(await asyncio.gather(*(one(session, r) for r in work)))


def _cell(deployment: compare.Deployment, model: str, work: list, stream: bool) -> dict[str, float]:
    """us of CPU per completion token, per front-end part."""
    before = deployment.cpu_by_part()
    tokens = asyncio.run(_ask(deployment.base_urls[0], model, work, stream))
    after = deployment.cpu_by_part()
    return {part: after[part].seconds_since(before[part]) * 1e6 / tokens for part in before}


def main() -> None:
    rounds, out_path = int(sys.argv[1]), Path(sys.argv[2])
    engine = dataclasses.replace(_engine(None), engines=2)
    log_dir = Path(tempfile.mkdtemp(prefix="cpu-floor-"))
    results: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack:
        tokenbus = compare.tokenbus_deployments(stack.enter_context(
            systems.tokenbus(engine, log_dir / "tokenbus.log", edges=1)))[compare.TOKENBUS]
        vllm = compare.vllm_serve_deployment(stack.enter_context(systems.vllm_serve(engine, log_dir / "vllm.log")))
        systems_up = {"tokenbus": tokenbus, "vllm serve": vllm}
        for deployment in systems_up.values():
            compare.warm_up(deployment, engine.model, "chat")
        for round_no in range(rounds):
            work = requests(SHAPE.requests, SHAPE.prompt_len, SHAPE.output_len, seed=7000 + round_no)
            order = list(systems_up) if round_no % 2 == 0 else list(reversed(systems_up))
            for name in order:
                for stream in (True, False):
                    time.sleep(1.0)
                    cell = _cell(systems_up[name], engine.model, work, stream)
                    key = f"{name}, {'streamed' if stream else 'whole'}"
                    results.setdefault(key, []).append(cell)
                    print(f"round {round_no + 1}: {key}: " + " + ".join(f"{p} {v:.0f}" for p, v in cell.items())
                          + f" = {sum(cell.values()):.0f} us/token", file=sys.stderr, flush=True)
    out_path.write_text(json.dumps(results, indent=1))
    _report(results)


def _report(results: dict[str, list[dict[str, float]]]) -> None:
    totals = {key: [sum(cell.values()) for cell in cells] for key, cells in results.items()}
    for key, cells in results.items():
        parts = {part: statistics.mean(cell[part] for cell in cells) for part in cells[0]}
        print(f"| {key} | " + " + ".join(f"{p} {v:.0f}" for p, v in parts.items())
              + f" = {statistics.mean(totals[key]):.0f} |")
    layer = [s - w for s, w in zip(totals["vllm serve, streamed"], totals["vllm serve, whole"], strict=True)]
    print(f"vllm serve's streaming layer: {statistics.mean(layer):.0f} us/token")
    for ours, theirs in (("tokenbus, streamed", "vllm serve, streamed"), ("tokenbus, whole", "vllm serve, whole")):
        ratio = paired_bootstrap_ratio(totals[ours], totals[theirs])
        print(f"{ours} / {theirs}: {ratio.estimate:.3f}x [{ratio.low:.3f}, {ratio.high:.3f}]")


if __name__ == "__main__":
    main()
