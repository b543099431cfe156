"""Schema and pattern checks bounded in time and off the edge's event loop (issue 33): what a planner defers,
the checking process (its deadline, its replacement, its turns by tenant), and an edge that keeps answering
while a pathological pattern is checked. No engine: a simulated worker answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from services.edge import schema_checks
from services.edge.formats import chat
from services.edge.formats.base import decode
from services.edge.schema_checks import Checker, Deferred
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, Overloaded
from tests.processes import metric_value
from tests.stack import Stack

USER = [{"role": "user", "content": "hi"}]
SLOW_PATTERN = "[\x00-\U0010ffff]" * 2000
"""10,000 characters that `re` takes seconds to compile (each class ~3.5 ms here): the loop's, before."""


def worst_schema(limit: int = 60 * 1024) -> dict[str, Any]:
    """The most nodes a schema of `limit` bytes may have: the slowest to walk and to check."""
    return {"prefixItems": [{}] * ((limit - 20) // 3)}


def wide_invalid(limit: int = 60 * 1024) -> dict[str, Any]:
    """Too large to be checked inline, and not a schema: its last property's type is 5."""
    properties: dict[str, Any] = {f"p{i}": {"type": "string", "maxLength": 10} for i in range(limit // 40)}
    properties["last"] = {"type": 5}
    return {"type": "object", "properties": properties}


def long_invalid(limit: int = 60 * 1024) -> dict[str, Any]:
    """Too large to be checked inline, and not a schema, with few properties (a function may take 15)."""
    return {"type": "object", "description": "d" * limit, "properties": {"a": {"type": 5}}}


def chat_job(**fields: Any) -> bus.Job:
    req = decode(json.dumps({"model": "m", "messages": USER, **fields}).encode(), chat.ChatCompletionRequest)
    return chat.to_job(req, job_id="j", reply_to="r", deadline_ms=1)


@pytest.fixture
async def checker() -> AsyncIterator[Checker]:
    made = Checker(deadline_s=0.3, busy_s=60)  # a wait bound far past what a loaded CI machine needs
    yield made
    await made.close()


def test_a_planner_defers_large_schemas_and_patterns_and_checks_small_ones_at_once() -> None:
    large = {"type": "json_schema", "json_schema": {"name": "s", "schema": wide_invalid()}}
    with schema_checks.deferring() as pending:
        chat_job(response_format=large)  # not refused yet
    assert [(c.kind, c.param) for c in pending] == [("schema", "response_format.json_schema.schema")]
    with schema_checks.deferring() as pending:
        chat_job(structured_outputs={"regex": "[0-9]+"})
    assert [(c.kind, c.param) for c in pending] == [("regex", "structured_outputs.regex")]
    small = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}}
    with schema_checks.deferring() as pending, pytest.raises(InvalidRequest) as caught:
        chat_job(response_format=small)
    assert caught.value.param == "response_format.json_schema.schema" and not pending
    with pytest.raises(InvalidRequest) as caught:  # nothing collects: checked inline, as before
        chat_job(response_format=large)
    assert caught.value.param == "response_format.json_schema.schema"


def test_a_requests_schemas_are_checked_inline_only_for_its_first_few_kib() -> None:
    """32 tools of 2 KiB each would cost the loop as much as one schema of 64 KiB."""
    tool = {"type": "object", "properties": {f"a{i}": {"type": "string", "description": "d" * 100}
                                             for i in range(12)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": tool}} for i in range(8)]
    with schema_checks.deferring() as pending:
        chat_job(tools=tools)
    size = len(orjson.dumps(tool))
    inline = schema_checks.INLINE_SCHEMA_BYTES // size
    assert [c.param for c in pending] == [f"tools[{i}].function.parameters" for i in range(inline, 8)]


async def test_deferred_checks_give_the_same_400s_and_pass_good_schemas(checker: Checker) -> None:
    fine = Deferred("schema", "a", orjson.dumps(worst_schema()))
    bad = Deferred("schema", "response_format.json_schema.schema", orjson.dumps(wide_invalid()))
    await checker.run([fine], "t")
    with pytest.raises(InvalidRequest, match="not a valid JSON schema") as caught:
        await checker.run([fine, bad, Deferred("regex", "r", b'"(unclosed"')], "t")
    assert caught.value.param == "response_format.json_schema.schema"
    deep = Deferred("schema", "tools", orjson.dumps(json.loads("[" * 70 + "]" * 70)))
    with pytest.raises(InvalidRequest, match="nested deeper") as caught:
        await checker.run([deep], "t")
    assert caught.value.param == "tools"


async def test_a_check_past_the_deadline_is_a_400_and_its_process_is_replaced(checker: Checker) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="took too long to check") as caught:
        await checker.run([Deferred("regex", "a", b'"x"'), Deferred("regex", "b", orjson.dumps(SLOW_PATTERN)),
                           Deferred("schema", "c", b"{}")], "t")
    assert caught.value.param == "b"
    # the compile alone takes ~7 s of CPU; refused at ~1 s of it, in wall time as the host's load allows
    assert time.monotonic() - started < 30
    await checker.run([Deferred("regex", "c", b'"[0-9]+"')], "t")  # a fresh process, in step


@contextlib.contextmanager
def stopped_process(checker: Checker) -> Iterator[None]:
    """The checking process stopped (SIGSTOP) in the block, as a host too busy to give it any CPU would leave it."""
    [slot] = checker._helpers._slots
    assert slot.running is not None
    pid = slot.running.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # replaced meanwhile
            os.kill(pid, signal.SIGCONT)


async def test_a_check_the_host_gives_little_cpu_is_judged_by_the_cpu_it_takes(checker: Checker) -> None:
    """Stopped for twice the deadline, then let go: the checks took no CPU time to speak of, so they pass (by the
    wall time, as before, a busy edge refused valid schemas)."""
    await checker._helpers.start()
    with stopped_process(checker):
        checking = asyncio.create_task(checker.run([Deferred("regex", "a", b'"[0-9]+"'),
                                                    Deferred("schema", "b", orjson.dumps(worst_schema()))], "t"))
        await asyncio.sleep(2 * checker.deadline_s)
    await checking


async def test_a_check_the_host_starves_past_the_wait_bound_is_a_503_and_the_next_is_checked() -> None:
    checker = Checker(deadline_s=0.3, busy_s=1.0)
    try:
        await checker._helpers.start()
        started = time.monotonic()
        with stopped_process(checker), pytest.raises(Overloaded, match="too busy to check"):
            await checker.run([Deferred("regex", "a", b'"[0-9]+"')], "t")
        assert time.monotonic() - started < 5
        await checker.run([Deferred("regex", "a", b'"[0-9]+"')], "t")  # a fresh process
    finally:
        await checker.close()


async def test_a_tenants_slow_checks_hold_anothers_back_by_one_at_most(checker: Checker) -> None:
    ended: list[str] = []

    async def check(tenant: str, pattern: str) -> None:
        with pytest.raises(InvalidRequest) if pattern == SLOW_PATTERN else contextlib.nullcontext():
            await checker.run([Deferred("regex", "r", orjson.dumps(pattern))], tenant)
        ended.append(tenant)

    flood = [asyncio.create_task(check("a", SLOW_PATTERN)) for _ in range(3)]
    await asyncio.sleep(0.05)  # a's first is being checked, the other two wait
    await check("b", "[0-9]+")
    await asyncio.gather(*flood)
    assert ended.index("b") <= 1, ended  # after a's first at most, not after all three


# An edge


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("schemas"))
    try:
        running.worker(sim_ttft_ms=5, sim_itl_ms=1)
        running.edge(auth="none")
        yield running
    finally:
        running.close()


async def test_the_edge_keeps_answering_while_a_pathological_pattern_is_checked(stack: Stack) -> None:
    """The pattern took the edge's loop for ~7 s: now it is refused after the deadline, and meanwhile the edge
    answers health checks and other requests, a worst-case 60 KiB schema among them, at once."""
    url = stack.edges[0].url
    slow = {"model": stack.model, "messages": USER, "max_tokens": 2, "structured_outputs": {"regex": SLOW_PATTERN}}
    worst = {"model": stack.model, "messages": USER, "max_tokens": 2,
             "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": worst_schema()}}}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/v1/chat/completions", json=worst)).status_code == 200  # the process started
        refused = asyncio.create_task(http.post("/v1/chat/completions", json=slow))
        lags = []
        while not refused.done():
            sent = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            lags.append(time.monotonic() - sent)
            await asyncio.sleep(0.02)
        answer = await refused
        served = await http.post("/v1/chat/completions", json=worst)
    assert len(lags) >= 10 and max(lags) < 0.25, lags
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "structured_outputs.regex"
    assert "took too long" in answer.json()["error"]["message"]
    assert served.status_code == 200, served.text


async def test_a_client_gone_while_its_pattern_is_checked_has_nothing_queued(stack: Stack) -> None:
    """A valid pattern slow to compile (~0.7 s of CPU here), its client gone meanwhile: the edge answers nobody and
    queues nothing (it queued the job, which a worker then took up, only for the edge to cancel it)."""
    worker = stack.workers[0]

    async def jobs() -> float:
        async with httpx.AsyncClient() as http:
            return metric_value((await http.get(worker.metrics_url)).text, "tokenbus_worker_jobs_total")

    pattern = "[\x00-\U0010ffff]" * 200
    body = {"model": stack.model, "messages": USER, "max_tokens": 2, "structured_outputs": {"regex": pattern}}
    async with httpx.AsyncClient(base_url=stack.edges[0].url, timeout=30) as http:
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200  # valid, and served
        before = await jobs()
        asking = asyncio.create_task(http.post("/v1/chat/completions", json=body))
        await asyncio.sleep(0.2)  # its pattern is being compiled
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        await asyncio.sleep(3)  # the check is done; a job queued would have been taken up and ended by now
    assert await jobs() == before


@pytest.mark.parametrize(("field", "value", "param"), [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": wide_invalid()}},
     "response_format.json_schema.schema"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 5}}},
     "response_format.json_schema.schema"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
               {"type": "function", "function": {"name": "g", "parameters": long_invalid()}}],
     "tools[1].function.parameters"),
    ("structured_outputs", {"regex": "(unclosed"}, "structured_outputs.regex"),
])
async def test_an_invalid_schema_or_pattern_is_a_400_naming_it_large_or_small(stack: Stack, field: str,
                                                                              value: Any, param: str) -> None:
    async with httpx.AsyncClient(base_url=stack.edges[0].url, timeout=30) as http:
        answer = await http.post("/v1/chat/completions", json={"model": stack.model, "messages": USER, field: value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
