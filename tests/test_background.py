"""Background responses (`background: true`), driven by the official openai SDK against real processes over the
simulated engine: answered queued at once, polled, streamed again from any sequence number on another edge,
cancelled, and run to their end when the edge that took them is killed."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from services.edge.background import BAR_GRACE_MS
from shared.protocol import keys
from shared.runtime.settings import Settings
from tests.processes import metric_value
from tests.stack import Stack


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _counted(tokens: int) -> str:
    return "".join(f" t{n}" for n in range(1, tokens + 1))


async def _until(client: openai.AsyncOpenAI, response_id: str, *statuses: str, timeout_s: float = 20.0) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await client.responses.retrieve(response_id)
        if found.status in statuses:
            return found
        assert time.monotonic() < deadline, f"still {found.status}"
        await asyncio.sleep(0.1)


async def test_a_background_response_outlives_its_edge_and_its_worker_and_streams_again_from_a_sequence_number(
        stack: Stack) -> None:
    first, second = stack.edge(), stack.edge()
    stack.worker()
    stack.worker()
    async with _client(first.url) as taker, _client(second.url) as other:
        created = await taker.responses.create(model=stack.model, input="count", max_output_tokens=150,
                                               background=True)
        assert created.status == "queued" and created.background is True and created.output == []
        running = await _until(other, created.id, "in_progress")
        assert running.usage is None
        stack.kill(first.process)  # the edge that took it dies: the job runs on, nobody waits for it
        await asyncio.sleep(0.5)  # some of its tokens are out
        stack.kill(stack.busiest().process)  # and its worker: another takes it over from its log
        done = await _until(other, created.id, "completed", "incomplete", timeout_s=30)
        # nothing lost, nothing repeated
        assert done.output_text == _counted(150) and done.usage is not None and done.usage.output_tokens == 150
        # streamed again on the other edge, after sequence number 5: the events that follow, each once
        stream = await other.responses.retrieve(created.id, stream=True, starting_after=5)
        events = [event async for event in stream]
        assert [event.sequence_number for event in events] == list(range(6, 6 + len(events)))
        assert events[-1].type == "response.incomplete" and events[-1].response.output_text == _counted(150)
        text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        assert _counted(150).endswith(text) and len(text) > 0
        # it was stored: it continues a conversation as any stored response does
        follow_up = await other.responses.create(model=stack.model, input="again", max_output_tokens=3,
                                                 previous_response_id=created.id)
    assert follow_up.status == "incomplete" and follow_up.usage is not None
    assert follow_up.usage.input_tokens > 150
    await stack.settled()


async def test_a_background_response_longer_than_the_replay_bound_is_rendered_whole_when_its_edge_dies(
        stack: Stack) -> None:
    """A job's log keeps --replay-max-events entries, but a background response's keeps all of its own: it is its
    only record until an edge stores its answer. The edge that took it dies; the other renders it from its log, from
    its start: in progress as it runs (not `queued`), and whole once it ended."""
    first, second = stack.edge(), stack.edge()
    stack.worker(replay_max_events=40)
    async with _client(first.url) as taker, _client(second.url) as other:
        created = await taker.responses.create(model=stack.model, input="count", max_output_tokens=300,
                                               background=True)  # 6 s of tokens: hundreds of log entries
        await _until(other, created.id, "in_progress")
        stack.kill(first.process)
        await asyncio.sleep(3)  # past 40 entries
        assert (await other.responses.retrieve(created.id)).status == "in_progress"
        done = await _until(other, created.id, "completed", "incomplete", timeout_s=30)
    assert done.output_text == _counted(300) and done.usage is not None and done.usage.output_tokens == 300
    await stack.settled()


async def test_a_cancelled_background_response_stops_its_job_and_says_cancelled(stack: Stack) -> None:
    edge, other_edge = stack.edge(), stack.edge()
    worker = stack.worker()
    async with _client(edge.url) as client, _client(other_edge.url) as other:
        created = await client.responses.create(model=stack.model, input="count", max_output_tokens=2000,
                                                background=True)
        deadline = time.monotonic() + 20
        while stack.client.xlen(keys.job_log(created.id)) < 4:  # it has begun to write (events after Started)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        cancelled = await other.responses.cancel(created.id)  # any edge cancels it
        assert cancelled.status == "cancelled"
        # the message it was writing is closed, as incomplete, with what it had written
        assert [(item.type, item.status) for item in cancelled.output] == [("message", "incomplete")]
        assert cancelled.output_text and _counted(2000).startswith(cancelled.output_text)
        assert (await client.responses.retrieve(created.id)).status == "cancelled"
        await stack.settled(timeout_s=10)  # the job stopped: its slot is free long before 2000 tokens (40 s)
        assert (await other.responses.cancel(created.id)).status == "cancelled"  # a second cancel changes nothing
        finished = await client.responses.create(model=stack.model, input="count", max_output_tokens=3,
                                                 background=True)
        done = await _until(client, finished.id, "incomplete")
        with pytest.raises(openai.BadRequestError) as ended:  # it ended before the cancel: it stays as it ended
            await client.responses.cancel(finished.id)
        assert ended.value.body["message"] == "Cannot cancel an incomplete response."
        assert (await client.responses.retrieve(finished.id)).status == "incomplete"
        foreground = await client.responses.create(model=stack.model, input="count", max_output_tokens=3)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.cancel(foreground.id)
        assert refused.value.body["param"] == "response_id"
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel("resp_unknown")
        with pytest.raises(openai.BadRequestError) as unstored:
            await client.responses.create(model=stack.model, input="count", background=True, store=False)
        assert unstored.value.body["param"] == "store"
    assert done.output_text == _counted(3) and done.completed_at is None  # OpenAI's is set once completed only
    assert worker.process.poll() is None
    async with httpx.AsyncClient(timeout=10) as http:
        taken, asked = (await http.get(edge.metrics_url)).text, (await http.get(other_edge.metrics_url)).text
    name = "tokenbus_edge_background_responses_total"
    assert metric_value(taken, name, {"event": "created"}) == 2  # the refused one was never created
    assert metric_value(taken, name, {"event": "incomplete"}) == 1
    assert metric_value(asked, name, {"event": "cancelled"}) == 1  # counted where it was stored: by the cancel
    assert not list(stack.client.scan_iter(keys.job_log("*"))) or all(
        stack.client.ttl(key) > 0 for key in stack.client.scan_iter(keys.job_log("*")))


async def test_a_streamed_background_response_runs_on_when_its_client_leaves_and_resumes_where_it_left(
        stack: Stack) -> None:
    """OpenAI's way to a stream that survives its connection: background and stream together, then a retrieve
    stream from the last sequence number the client saw."""
    first, second = stack.edge(resume_window_s=0), stack.edge()
    stack.worker()
    async with _client(first.url) as client, _client(second.url) as other:
        stream = await client.responses.create(model=stack.model, input="count", max_output_tokens=200,
                                               background=True, stream=True)
        seen, text, response_id, opening = -1, "", "", []
        async for event in stream:
            seen = event.sequence_number
            if seen < 3:
                opening.append((event.type, event.model_dump()["response"]["status"]))
            if event.type == "response.created":
                response_id = event.response.id
                assert event.response.background is True
            elif event.type == "response.output_text.delta":
                text += event.delta
                if len(text) > 20:
                    break
        await stream.close()  # the client leaves: with no resume window, a foreground stream would stop here
        await asyncio.sleep(0.5)
        rest = await other.responses.retrieve(response_id, stream=True, starting_after=seen)
        events = [event async for event in rest]
    assert opening == [("response.created", "queued"), ("response.queued", "queued"),  # OpenAI's opening
                       ("response.in_progress", "in_progress")]
    assert events[0].sequence_number == seen + 1
    text += "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == _counted(200) and events[-1].type == "response.incomplete"
    async with _client(second.url) as other:
        assert (await other.responses.retrieve(response_id)).output_text == _counted(200)  # stored by the reader



async def test_polling_a_running_background_response_reads_its_log_at_most_once_a_second(stack: Stack) -> None:
    """A client polling in a loop sees the response as it runs (at most a second old: it sees it end) and costs
    the edge one read of the job's log a second (each read is the whole log, up to --replay-max-events entries,
    rendered again)."""
    edge = stack.edge()
    stack.worker()
    async with _client(edge.url) as client:
        created = await client.responses.create(model=stack.model, input="count", max_output_tokens=200,
                                                background=True)  # 4 s of tokens
        await _until(client, created.id, "in_progress")

        def log_reads() -> int:
            return int(stack.client.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0))

        before, started = log_reads(), time.monotonic()
        polled = [(await client.responses.retrieve(created.id)).status for _ in range(40)]
        took = time.monotonic() - started
        reads = log_reads() - before
        done = await _until(client, created.id, "incomplete")
    assert reads <= took + 2, f"{reads} reads of the log for 40 polls in {took:.1f} s"
    assert "in_progress" in polled and done.output_text == _counted(200)


async def test_a_background_response_streamed_on_another_edge_is_stored_when_its_reader_leaves_early(
        stack: Stack) -> None:
    """Streaming a background response moves its events to the edge that streams it: when that client leaves
    before the end, that edge follows the response on and stores its answer (it was stored only once someone
    asked for it)."""
    first, second = stack.edge(), stack.edge()
    stack.worker()
    async with _client(first.url) as client, _client(second.url) as other:
        created = await client.responses.create(model=stack.model, input="count", max_output_tokens=150,
                                                background=True)  # 3 s of tokens
        stream = await other.responses.retrieve(created.id, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        await stream.close()
    deadline = time.monotonic() + 15
    while not stack.client.exists(keys.stored_response("", created.id)):
        assert time.monotonic() < deadline, "the answer was not stored"
        await asyncio.sleep(0.2)
    async with _client(first.url) as client:
        assert (await client.responses.retrieve(created.id)).output_text == _counted(150)


async def test_a_deleted_background_response_is_gone_from_every_route_running_or_ended(stack: Stack) -> None:
    """DELETE of a background response: gone for good (its record and log with it, never rebuilt from them nor
    stored again by the edge that follows it), and one still running is cancelled first."""
    edge, other_edge = stack.edge(), stack.edge()
    stack.worker()
    async with _client(edge.url) as client, _client(other_edge.url) as other:
        ended = await client.responses.create(model=stack.model, input="count", max_output_tokens=3, background=True)
        await _until(client, ended.id, "incomplete")
        running = await client.responses.create(model=stack.model, input="count", max_output_tokens=2000,
                                                background=True)
        await _until(client, running.id, "in_progress")
        for response_id in (ended.id, running.id):
            await other.responses.delete(response_id)  # any edge deletes it (the SDK raises on an error)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(response_id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.input_items.list(response_id)
            with pytest.raises(openai.NotFoundError):
                await client.responses.delete(response_id)
            with pytest.raises(openai.BadRequestError) as continued:
                await client.responses.create(model=stack.model, input="more", previous_response_id=response_id)
            assert continued.value.code == "previous_response_not_found"
        assert not stack.client.exists(keys.job_log(ended.id), keys.job_record(ended.id), keys.job_record(running.id))
        await stack.settled(timeout_s=10)  # the running one was cancelled: its slot is free long before 40 s
        await asyncio.sleep(1)  # its follower saw it end: it stored nothing
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(running.id)
    assert not stack.client.exists(keys.stored_response("", ended.id))
    # the running one's id is barred (an empty value) until its job's deadline has passed: nothing is stored there
    assert stack.client.get(keys.stored_response("", running.id)) == b""
    barred_ms = stack.client.pttl(keys.stored_response("", running.id))
    assert 0 < barred_ms <= BAR_GRACE_MS + Settings().request_timeout_s * 1000


async def _slowest_health_s(url: str, busy: asyncio.Task[object]) -> float:
    """The slowest of the edge's /health answers, asked for back to back while `busy` runs."""
    slowest = 0.0
    async with httpx.AsyncClient(timeout=10) as http:
        while not busy.done():
            asked = time.monotonic()
            assert (await http.get(url + "/health")).status_code == 200
            slowest = max(slowest, time.monotonic() - asked)
    await busy
    return slowest


async def test_the_retrieves_and_cancels_of_long_background_responses_never_hold_the_edge(stack: Stack) -> None:
    """A retrieve of a running background response renders its job's log, and so did a cancel: read and rendered
    whole (15,000 events here, up to --replay-max-events), each held the edge's loop ~0.2 s (a cancel spends no
    rpm: a tenant's eight at once of an ended response held /health ~0.4 s). The log is rendered a page at a time,
    and a cancel of an ended response answers from what was stored, without reading the log. (Each /health bound
    is over the slowest one of the same moment without them, twice: a loaded host slows both.)"""
    edge = stack.edge()
    stack.worker(sim_itl_ms=0.2, max_num_seqs=8, max_model_len=32768)
    async with _client(edge.url) as client:
        created = [await client.responses.create(model=stack.model, input="count", max_output_tokens=15000,
                                                 background=True) for _ in range(4)]
        deadline = time.monotonic() + 60

        async def long_logs() -> None:
            while any(stack.client.xlen(keys.job_log(c.id)) < 10_000 for c in created):  # long logs, still running
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)

        running = await _slowest_health_s(edge.url, asyncio.create_task(long_logs()))
        async def retrieve_all() -> object:
            return await asyncio.gather(*(client.responses.retrieve(c.id) for c in created))

        polling = await _slowest_health_s(edge.url, asyncio.create_task(retrieve_all()))
        for response in created:
            await _until(client, response.id, "incomplete", timeout_s=60)
        log_reads = int(stack.client.info("commandstats").get("cmdstat_xrange", {}).get("calls", 0))
        ended = await _slowest_health_s(edge.url, asyncio.create_task(asyncio.sleep(1)))

        async def cancel_all() -> object:
            return await asyncio.gather(*(client.responses.cancel(created[0].id) for _ in range(8)),
                                        return_exceptions=True)

        cancelling = asyncio.create_task(cancel_all())
        cancels = await _slowest_health_s(edge.url, cancelling)
        answers = cancelling.result()
    assert all(isinstance(a, openai.BadRequestError) and a.body["message"] == "Cannot cancel an incomplete response."
               for a in answers), answers
    assert polling < 0.12 + 2 * running and cancels < 0.12 + 2 * ended, (
        f"/health: up to {polling:.3f} s on retrieves ({running:.3f} s without), {cancels:.3f} s on cancels "
        f"({ended:.3f} s without)")
    assert int(stack.client.info("commandstats")["cmdstat_xrange"]["calls"]) == log_reads
