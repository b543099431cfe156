"""One streamed request against an OpenAI-compatible server, timed the way `vllm bench serve` times it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from services.bench.workload import Request


@dataclass
class Timing:
    """When each part of one response arrived (perf_counter seconds)."""

    start: float
    first_chunk: float | None = None
    content: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried generated text."""
    end: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.content)

    @property
    def ttft(self) -> float:
        return self.content[0] - self.start

    @property
    def ttfc(self) -> float:
        """Time to the first chunk of any kind (a role-only chat chunk counts)."""
        return (self.first_chunk or self.content[0]) - self.start

    @property
    def latency(self) -> float:
        return (self.end or self.content[-1]) - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, as vLLM defines it."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.content, self.content[1:], strict=False)]


JSON = {"Content-Type": "application/json"}


def body_for(api: str, model: str, request: Request) -> dict[str, Any]:
    common = {"model": model, "max_tokens": request.max_tokens, "stream": True, "ignore_eos": True,
              "temperature": 0.0, "stream_options": {"include_usage": True}}
    if api == "chat":
        return {**common, "messages": [{"role": "user", "content": request.prompt}]}
    return {**common, "prompt": request.prompt}


def read_frame(api: str, data: bytes, timing: Timing, now: float) -> None:
    """Records one SSE `data:` payload into the timing."""
    if data == b"[DONE]":
        return
    if timing.first_chunk is None:
        timing.first_chunk = now
    chunk = orjson.loads(data)
    if "error" in chunk:
        timing.error = str(chunk["error"])[:200]
        return
    for choice in chunk.get("choices") or ():
        text = (choice.get("delta") or {}).get("content") if api == "chat" else choice.get("text")
        if text:
            timing.content.append(now)
    if usage := chunk.get("usage"):
        timing.output_tokens = usage.get("completion_tokens", 0)
        timing.prompt_tokens = usage.get("prompt_tokens", 0)


async def send(session: aiohttp.ClientSession, url: str, api: str, model: str, request: Request) -> Timing:
    timing = Timing(start=time.perf_counter())
    try:
        async with session.post(url, data=orjson.dumps(body_for(api, model, request)), headers=JSON) as response:
            if response.status != 200:
                timing.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return timing
            async for line in response.content:
                if line.startswith(b"data: "):
                    read_frame(api, line[6:].rstrip(), timing, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.end = time.perf_counter()
    if timing.output_tokens == 0:
        timing.output_tokens = len(timing.content)
    return timing
