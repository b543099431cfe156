"""The Batch API, driven by the official openai SDK against real processes (edges, simulated workers, Redis):
a batch runs its lines in the batch lane and writes its output and error files in the input's order; it outlives
the edge that took it (SIGKILL: another edge finishes it, each custom_id answered exactly once); it can be
cancelled, and its completion window is honoured."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai.types import Batch
from openai.types.chat import ChatCompletion

from shared.protocol import keys
from shared.tenancy import apikeys
from tests.processes import metric_value
from tests.stack import Stack


def line(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(model: str, text: str, tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(one) + "\n" for one in lines).encode()


async def submitted(client: openai.AsyncOpenAI, asked: list[dict[str, Any]], window: str = "24h") -> Batch:
    """A batch of these chat lines, uploaded and created as a client does."""
    uploaded = await client.files.create(file=("requests.jsonl", jsonl(asked)), purpose="batch")
    return await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                       completion_window=window)


async def ended(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 60) -> Batch:
    deadline = time.monotonic() + timeout_s
    while (batch := await client.batches.retrieve(batch_id)).status not in ("completed", "failed", "expired",
                                                                              "cancelled"):
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.2)
    return batch


async def answered(client: openai.AsyncOpenAI, batch_id: str, at_least: int = 1, timeout_s: float = 30) -> None:
    """Waits until the batch has answered `at_least` lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = (await client.batches.retrieve(batch_id)).request_counts
        if counts is not None and counts.completed >= at_least:
            return
        assert time.monotonic() < deadline, counts
        await asyncio.sleep(0.05)


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
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(edge.metrics_url)).text
    lines_done = {outcome: metric_value(metrics, "tokenbus_edge_batch_lines_total", {"outcome": outcome})
                  for outcome in ("completed", "failed")}
    assert lines_done == {"completed": 5, "failed": 2}
    assert metric_value(metrics, "tokenbus_edge_batches_total", {"event": "completed"}) == 1
    assert metric_value(metrics, "tokenbus_edge_batch_lines_running") == 0
    assert metric_value(metrics, "tokenbus_edge_batch_lines_waiting") == 0
    # its answers left Redis for its files: nothing of it is charged twice, nothing stays open
    assert stack.client.hget(keys.storage_tally(""), f"b:{batch.id}") is None
    assert not stack.client.exists(keys.batch_lines("", batch.id))
    assert stack.client.zcard(keys.BATCHES_OPEN) == 0
    await stack.settled()


async def test_a_batch_outlives_its_edge_and_a_worker_each_line_answered_exactly_once(stack: Stack) -> None:
    """1,000 lines; SIGKILL of the edge driving the batch, which is then started again, and of a worker running
    its lines: another edge takes the batch over once the lease runs out, the killed worker's jobs continue
    elsewhere, and the output holds every custom_id exactly once."""
    settings = {"batch_lease_ttl_s": 1.5}
    driving, other = stack.edge(**settings), stack.edge(**settings)
    stack.worker(sim_itl_ms=10, max_num_seqs=32)
    stack.worker(sim_itl_ms=10, max_num_seqs=32)
    total = 1000
    asked = [line(f"line-{i}", chat(stack.model, f"question {i}", tokens=6)) for i in range(total)]
    async with openai.AsyncOpenAI(base_url=driving.url + "/v1", api_key="unused", max_retries=0) as client, \
            openai.AsyncOpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0) as survivor:
        batch = await submitted(client, asked)
        await answered(survivor, batch.id, at_least=100)
        stack.kill(driving.process)
        stack.edges.remove(driving)
        stack.edge(**settings)  # the edge, restarted
        await answered(survivor, batch.id, at_least=300)
        stack.kill(stack.busiest().process)
        done = await ended(survivor, batch.id, timeout_s=120)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (total, 0)
        output = await lines_of(survivor, done.output_file_id)
        assert [one["custom_id"] for one in output] == [f"line-{i}" for i in range(total)]
        assert all(ChatCompletion.model_validate(one["response"]["body"]).usage.completion_tokens == 6
                   for one in output)
        assert done.error_file_id is None
    await stack.settled(timeout_s=20)


async def test_a_batch_is_cancelled_at_once_and_another_expires_with_its_window(stack: Stack) -> None:
    edge = stack.edge(batch_window=2)
    stack.worker(sim_itl_ms=40, max_num_seqs=4)
    slow = [line(f"s{i}", chat(stack.model, f"question {i}", tokens=10)) for i in range(30)]
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        uploaded = await client.files.create(file=("requests.jsonl", jsonl(slow)), purpose="batch")
        cancelled = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
        expiring = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="3s")
        await answered(client, cancelled.id)
        cancelling = await client.batches.cancel(cancelled.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        asked_at = time.monotonic()
        done = await ended(client, cancelled.id)
        assert done.status == "cancelled" and done.cancelled_at and time.monotonic() - asked_at < 5
        assert done.request_counts is not None and 0 < done.request_counts.completed < 30
        assert len(await lines_of(client, done.output_file_id)) == done.request_counts.completed
        with pytest.raises(openai.BadRequestError):
            await client.batches.cancel(cancelled.id)  # it ended: it stays as it ended

        expired = await ended(client, expiring.id)
        assert expired.status == "expired" and expired.expired_at
        assert expired.request_counts is not None
        assert expired.request_counts.completed + expired.request_counts.failed == 30
        assert 0 < expired.request_counts.completed < 30
        errors = await lines_of(client, expired.error_file_id)
        assert {one["error"]["code"] for one in errors} == {"batch_expired"} and all(
            one["response"] is None for one in errors)
        kept = await lines_of(client, expired.output_file_id)
        assert sorted(one["custom_id"] for one in kept + errors) == sorted(f"s{i}" for i in range(30))
    await stack.settled()


async def test_interactive_work_goes_before_a_batchs_queued_lines(stack: Stack) -> None:
    """Four slots, a batch with 64 lines queued or running (16 waves of 0.4 s): a chat request sent meanwhile waits
    at most for one slot to free, not behind the batch's queue."""
    edge = stack.edge(batch_window=64)
    stack.worker(sim_itl_ms=20, max_num_seqs=4, fair_headroom=0)
    asked = [line(f"b{i}", chat(stack.model, f"question {i}", tokens=20)) for i in range(64)]
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        batch = await submitted(client, asked)
        await answered(client, batch.id)
        waits = []
        for _ in range(3):
            sent = time.monotonic()
            stream = await client.chat.completions.create(model=stack.model, max_tokens=2, stream=True,
                                                          messages=[{"role": "user", "content": "now"}])
            async for _chunk in stream:
                waits.append(time.monotonic() - sent)
                break
            await stream.close()
        assert max(waits) < 1.5, waits  # behind the batch's queue it would be seconds
        progress = await client.batches.retrieve(batch.id)
        assert progress.status == "in_progress" and progress.request_counts is not None
        assert progress.request_counts.completed < 48  # the batch was still far from done
        await client.batches.cancel(batch.id)
        await ended(client, batch.id)
    await stack.settled()


async def test_a_batch_that_cannot_run_is_refused_or_fails_with_a_reason(stack: Stack) -> None:
    edge = stack.edge()
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        good = await client.files.create(file=("in.jsonl", jsonl([line("a", chat(stack.model, "hi"))])),
                                         purpose="batch")
        notes = await client.files.create(file=("notes.txt", b"just notes"), purpose="user_data")
        for asked, param in (({"input_file_id": good.id, "endpoint": "/v1/images/generations",
                               "completion_window": "24h"}, "endpoint"),
                             ({"input_file_id": good.id, "endpoint": "/v1/chat/completions",
                               "completion_window": "1y"}, "completion_window"),
                             ({"input_file_id": notes.id, "endpoint": "/v1/chat/completions",
                               "completion_window": "24h"}, "input_file_id")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.batches.create(**asked)
            assert refused.value.body["param"] == param
        for call in (client.batches.create(input_file_id="file-none", endpoint="/v1/chat/completions",
                                           completion_window="24h"),
                     client.batches.retrieve("batch_none"), client.batches.cancel("batch_none")):
            with pytest.raises(openai.NotFoundError):
                await call
        # a line for another endpoint fails the batch before anything runs, naming the line
        mixed = await client.files.create(file=("in.jsonl", jsonl([
            line("a", chat(stack.model, "hi")), line("b", {"model": stack.model, "input": "x"}, "/v1/embeddings")])),
            purpose="batch")
        failed = await ended(client, (await client.batches.create(
            input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h")).id)
        assert failed.status == "failed" and failed.failed_at and failed.errors and failed.errors.data
        assert [(e.code, e.line) for e in failed.errors.data] == [("invalid_url", 2)]
        assert failed.output_file_id is None and failed.error_file_id is None


async def test_tenants_batches_share_the_batch_lane_fairly(stack: Stack) -> None:
    """Eight slots; tenant A runs three batches, tenant B one: the lane is shared per tenant, not per batch (or
    per line), so B's lines go as fast as all of A's together."""
    edge = stack.edge(auth="keys", batch_window=16)
    stack.worker(sim_itl_ms=20, max_num_seqs=8, fair_headroom=0)
    admin = aioredis.Redis.from_url(stack.url, **stack.redis.client_options(), **stack.login)
    keys_made = [(await apikeys.create(admin, apikeys.KeyChanges(tenant=tenant)))[0] for tenant in ("a", "b")]
    await admin.aclose()
    asked = jsonl([line(f"l{i}", chat(stack.model, f"question {i}", tokens=10)) for i in range(200)])
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=keys_made[0], max_retries=0) as a, \
            openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key=keys_made[1], max_retries=0) as b:
        runs: dict[str, list[str]] = {}
        for name, client, count in (("a", a, 3), ("b", b, 1)):
            uploaded = await client.files.create(file=("requests.jsonl", asked), purpose="batch")
            runs[name] = [(await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h")).id for _ in range(count)]
        await asyncio.sleep(5)
        done = {}
        for name, client in (("a", a), ("b", b)):
            batches = [await client.batches.retrieve(batch_id) for batch_id in runs[name]]
            done[name] = sum(one.request_counts.completed for one in batches if one.request_counts)
            for batch_id in runs[name]:
                await client.batches.cancel(batch_id)
    assert done["a"] + done["b"] > 100  # the worker was busy: about 8 slots x 5 s / 0.25 s
    assert done["b"] / done["a"] == pytest.approx(1.0, abs=0.35), done  # FIFO or per-batch shares: 0.33


async def test_a_batch_waits_out_a_restart_of_its_models_only_worker(stack: Stack) -> None:
    """SIGKILL of the model's only worker mid-batch: its lines are not failed (worker lost, then no live worker of
    a model the deployment serves) but run again once a new worker is up; every line is answered once."""
    edge = stack.edge(batch_window=8)
    doomed = stack.worker(sim_itl_ms=20, max_num_seqs=4)
    asked = [line(f"r{i}", chat(stack.model, f"question {i}", tokens=10)) for i in range(40)]
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        batch = await submitted(client, asked)
        await answered(client, batch.id, at_least=8)
        stack.kill(doomed.process)
        stack.workers.remove(doomed)
        await asyncio.sleep(9)  # its jobs are given up for lost (the edge waits ~7 s here for a takeover)
        waiting = await client.batches.retrieve(batch.id)
        assert waiting.status == "in_progress" and waiting.request_counts is not None
        assert waiting.request_counts.failed == 0
        stack.worker(sim_itl_ms=20, max_num_seqs=4)
        done = await ended(client, batch.id)
        assert done.status == "completed" and done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
        output = await lines_of(client, done.output_file_id)
        assert [one["custom_id"] for one in output] == [f"r{i}" for i in range(40)]
    await stack.settled()


async def test_a_batch_s_files_are_written_a_chunk_at_a_time_however_large_its_answers(stack: Stack) -> None:
    """40 MB of answers (of 20,000 lines, some failed) become the output and error files in the input's order,
    read and written a chunk at a time: the edge's peak memory grows by far less than the answers (built whole,
    the files held 3.6 times their size at once, 230 MB for 64 MB, and the edge's loop ~120 ms)."""
    edge = stack.edge()
    stack.worker(sim_ttft_ms=5_000)  # the answers are written here before any line answers
    total, pad = 20_000, "w" * 2000
    asked = [line(f"c{i}", chat(stack.model, "q", tokens=1)) for i in range(total)]
    answers = [b"%s{\"custom_id\":\"c%d\",\"pad\":\"%s\"}" % (b"e" if i % 7 == 0 else b"o", i, pad.encode())
               for i in range(total)]
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        batch = await submitted(client, asked)
        pipe = stack.client.pipeline(transaction=False)
        for i, answer in enumerate(answers):
            pipe.hset(keys.batch_lines("", batch.id), f"c{i}", answer)
        pipe.execute()
        before = peak_rss_mb(edge.process.pid)
        await client.batches.cancel(batch.id)
        done = await ended(client, batch.id, timeout_s=30)
        grown = peak_rss_mb(edge.process.pid) - before
        assert done.status == "cancelled" and done.output_file_id and done.error_file_id
        for file_id, kind in ((done.output_file_id, b"o"), (done.error_file_id, b"e")):
            data = (await client.files.content(file_id)).content
            assert data == b"".join(answer[1:] + b"\n" for answer in answers if answer[:1] == kind)
    assert grown < 25, f"writing 40 MB of answers into files grew the edge's peak memory by {grown:.0f} MB"
    await stack.settled(timeout_s=20)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM)."""
    for status in Path(f"/proc/{pid}/status").read_text().splitlines():
        if status.startswith("VmHWM:"):
            return int(status.split()[1]) / 1024
    raise AssertionError("no VmHWM")
