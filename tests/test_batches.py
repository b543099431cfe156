"""The Batch API, driven by the official openai SDK against real processes (edges, simulated workers, Redis):
a batch runs its lines in the batch lane and writes its output and error files in the input's order; it outlives
the edge that took it (SIGKILL: another edge finishes it, each custom_id answered exactly once); it can be
cancelled, and its completion window is honoured."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import openai
from openai.types import Batch
from openai.types.chat import ChatCompletion

from shared.protocol import keys
from tests.stack import Stack


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(model: str, text: str, tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(one) + "\n" for one in lines).encode()


async def ended(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 60) -> Batch:
    deadline = time.monotonic() + timeout_s
    while (batch := await client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired",
                                                                              "cancelled"):
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)
    return batch


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    data = (await client.files.content(file_id)).content
    return [json.loads(raw) for raw in data.splitlines()]


async def test_a_batch_answers_every_line_once_in_order_with_failures_apart(stack: Stack) -> None:
    edge = stack.edge()
    stack.worker(sim_itl_ms=2)
    asked = [line(f"q{i}", chat(stack.model, f"question {i}", tokens=3 + i)) for i in range(5)]
    asked.insert(2, line("unknown-model", chat("no-such-model", "hello")))
    asked.append(line("streamed", {**chat(stack.model, "hi"), "stream": True}))
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        uploaded = await client.files.create(file=("requests.jsonl", jsonl(asked)), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"run": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"run": "nightly"}
        assert batch.request_counts is not None and batch.request_counts.total == 7
        done = await ended(client, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 2)
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        output = await lines_of(client, done.output_file_id)
        assert [one["custom_id"] for one in output] == [f"q{i}" for i in range(5)]  # the input's order
        for i, one in enumerate(output):
            assert one["response"]["status_code"] == 200 and one["error"] is None
            answer = ChatCompletion.model_validate(one["response"]["body"])
            assert answer.usage is not None and answer.usage.completion_tokens == 3 + i
            assert answer.choices[0].finish_reason == "length"
        errors = await lines_of(client, done.error_file_id)
        assert [one["custom_id"] for one in errors] == ["unknown-model", "streamed"]
        assert [one["response"]["status_code"] for one in errors] == [404, 400]
        assert errors[1]["response"]["body"]["error"]["param"] == "stream"
        assert [b.id async for b in client.batches.list()] == [batch.id]
        usage = sum(json.loads(json.dumps(one["response"]["body"]["usage"]))["completion_tokens"] for one in output)
        assert done.usage is not None and done.usage.output_tokens == usage
    # its answers left Redis for its files: nothing of it is charged twice, nothing stays open
    assert stack.client.hget(keys.storage_tally(""), f"b:{batch.id}") is None
    assert not stack.client.exists(keys.batch_lines("", batch.id))
    assert stack.client.zcard(keys.BATCHES_OPEN) == 0
    await stack.settled()
