"""Faults as they happen in production: separate edge, worker and Redis processes killed or stopped mid-stream.

The workers run the simulated engine (a fault-testing tool: token n of a choice is " t{n}"), so every test can
check each client's exact token sequence: nothing lost, nothing repeated, one outcome per request. After each
fault, nothing stays pending in the queue, no edge has a request in flight and no worker runs a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
import subprocess
import time
import urllib.parse
from typing import Any

import httpx
import openai
import orjson
import pytest

from shared.protocol import bus, keys
from tests.processes import Edge, WorkerProcess, metric_value, start_edge
from tests.stack import FAST_BEATS, Stack


async def exits_cleanly(process: Edge | WorkerProcess, within_s: float) -> None:
    """The process ends with status 0 within `within_s`; else the end of its log says what it was doing."""
    try:
        status: int | None = await asyncio.to_thread(process.process.wait, within_s)
    except subprocess.TimeoutExpired:
        status = None
    assert status == 0, f"{process.log.name} ended with {status}:\n{process.log.read_text()[-4000:]}"


def expected(tokens: int) -> str:
    return "".join(f" t{n}" for n in range(1, tokens + 1))


async def stream_text(url: str, model: str, tokens: int, first_token: asyncio.Event | None = None,
                      **extra: object) -> tuple[str, int]:
    """A streamed chat through the openai SDK: the text and the completion tokens its usage reports; sets
    `first_token` when the first text arrives."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "count"}], max_tokens=tokens, stream=True,
            stream_options={"include_usage": True}, **extra)
        text, usage = "", -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if text and first_token is not None:
                    first_token.set()
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage


async def streaming(url: str, model: str, tokens: int, **extra: object) -> asyncio.Task[tuple[str, int]]:
    """A `stream_text` running, returned once its first token reached the client (within 10 s): a fault after
    it lands mid-stream however slow the machine (a fixed sleep could kill a worker before the job reached it)."""
    first_token = asyncio.Event()
    stream = asyncio.create_task(stream_text(url, model, tokens, first_token, **extra))
    arrived = asyncio.create_task(first_token.wait())
    await asyncio.wait([stream, arrived], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    arrived.cancel()
    assert first_token.is_set(), "no token within 10 s" if not stream.done() else stream.result()
    return stream


async def test_a_worker_killed_mid_stream_ends_no_stream(stack: Stack) -> None:
    """32 streams over 2 edges and 2 workers; kill -9 of the busiest worker: all 32 get all their tokens."""
    edges = [stack.edge(), stack.edge()]
    stack.worker()
    stack.worker()
    streams = [asyncio.create_task(stream_text(edges[i % 2].url, stack.model, 100)) for i in range(32)]
    await asyncio.sleep(0.8)
    dead = stack.busiest().process
    stack.kill(dead)
    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert all(result == (expected(100), 100) for result in results), [r for r in results if r[1] != 100][:3]
    await stack.settled()
    deadline = time.monotonic() + 10  # the survivor removes the dead consumer from the group
    while any(f"-{dead.pid}-" in c["name"].decode() for c in stack.consumers()):
        assert time.monotonic() < deadline, "the dead worker is still a consumer of the group"
        await asyncio.sleep(0.2)


async def test_a_kill_soak_loses_nothing(stack: Stack) -> None:
    """240 requests while a worker is killed (and a new one started) six times: all complete, none pending."""
    edges = [stack.edge(), stack.edge()]
    # killing the busiest worker six times can catch one job more often than the poison-job bound (3, tested
    # on its own below) allows; this soak is about migration, so the bound is lifted past the kill count
    survives = {"max_reclaims": 6}
    stack.worker(**survives)
    stack.worker(**survives)
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> tuple[str, int]:
        async with gate:
            return await stream_text(edges[i % 2].url, stack.model, 30)

    requests = [asyncio.create_task(one(i)) for i in range(240)]
    for _ in range(6):
        await asyncio.sleep(1.0)
        stack.kill(stack.busiest().process)
        await asyncio.to_thread(stack.worker, **survives)
    results = await asyncio.wait_for(asyncio.gather(*requests), 120)
    assert sum(result == (expected(30), 30) for result in results) == 240
    await stack.settled()
    assert stack.client.xlen(keys.dead_letters(stack.model)) == 0


@pytest.mark.parametrize("stack", ["tcp", "unix"], indirect=True)
async def test_redis_killed_and_restarted(stack: Stack) -> None:
    """While Redis is down: 503 with Retry-After at once, streams in flight end with an error event; after its
    restart everything serves again, with no process restarted, and the job of the stream that ended stops
    (its cancel waited for Redis) without its worker claiming it from itself. Over TCP, and over the Unix socket
    that `tokenbus run` uses for its private Redis."""
    assert stack.url.startswith("unix://" if stack.unix_socket else "redis://")
    edge = stack.edge()
    stack.worker()
    assert (await stream_text(edge.url, stack.model, 5))[0] == expected(5)
    in_flight = await streaming(edge.url, stack.model, 2000)
    stack.redis.kill()
    killed = time.monotonic()
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as http:
        refused = await http.post("/v1/chat/completions", json={**chat_body(stack.model, 5), "stream": False})
        assert time.monotonic() - killed < 1.0
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "redis_unavailable"
        tgi = await http.post("/generate", json={"inputs": "count"})
        assert tgi.status_code == 503 and tgi.headers["Retry-After"] and "error" in tgi.json()
        with pytest.raises(openai.APIError, match="queue"):
            await asyncio.wait_for(in_flight, 8)
        assert (await http.get("/ready")).status_code == 503
        stack.redis.start()
        restarted = time.monotonic()
        while (await http.get("/ready")).status_code != 200:
            assert time.monotonic() - restarted < 10
            await asyncio.sleep(0.2)
    while True:  # a client retries the 503 that says the worker is coming back (SDKs do by default)
        try:
            assert (await stream_text(edge.url, stack.model, 5))[0] == expected(5)
            break
        except openai.InternalServerError as exc:
            # CI: /ready was 200 after the worker's first beat, which then lapsed (a 2 s TTL here) before the next
            assert exc.status_code == 503 and "no live worker" in exc.message and \
                time.monotonic() - restarted < 15, exc
            await asyncio.sleep(0.2)
    await stack.settled()
    async with httpx.AsyncClient() as http:
        worker_metrics = (await http.get(stack.workers[0].metrics_url)).text
    assert metric_value(worker_metrics, "tokenbus_worker_engine_aborts_total") == 1
    assert metric_value(worker_metrics, "tokenbus_worker_reclaimed_entries_total") == 0
    assert all(p.process.poll() is None for p in [*stack.edges, *stack.workers])


async def test_a_stopped_worker_hands_its_running_jobs_over(stack: Stack) -> None:
    """SIGTERM on a worker with long streams: past its grace it hands them over; their clients see no seam."""
    edge = stack.edge()
    stopping = stack.worker(worker_grace_s=0.5)
    # 500 tokens: 10 s, long enough to still run once the second worker is up on a busy machine
    streams = [asyncio.create_task(stream_text(edge.url, stack.model, 500)) for _ in range(8)]
    async with httpx.AsyncClient() as http:  # all eight run on the worker to stop (a sleep lost them on a busy machine)
        deadline = time.monotonic() + 10
        while metric_value((await http.get(stopping.metrics_url)).text, "tokenbus_worker_running_jobs") < 8:
            assert time.monotonic() < deadline, "the streams did not reach the worker"
            await asyncio.sleep(0.05)
    stack.worker()
    stopping.process.send_signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert all(result == (expected(500), 500) for result in results)
    await exits_cleanly(stopping, 20)
    assert "handed 8 running jobs over" in stopping.log.read_text()
    await stack.settled()


async def sse_frames(http: httpx.AsyncClient, method: str, url: str, limit: int | None = None,
                     **kwargs: object) -> list[tuple[str, str]]:
    """(id, data) of each SSE event, at most `limit` of them (then the connection is dropped)."""
    frames: list[tuple[str, str]] = []
    event_id = ""
    headers = {"Accept": "text/event-stream", **kwargs.pop("headers", {})}  # type: ignore[dict-item]
    async with http.stream(method, url, headers=headers, **kwargs) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                frames.append((event_id, line[6:]))
                if limit is not None and len(frames) >= limit:
                    break
    return frames


def chat_body(model: str, tokens: int) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "count"}], "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}}


async def test_a_cut_stream_resumes_on_the_other_edge_with_nothing_lost_or_repeated(stack: Stack) -> None:
    first, second = stack.edge(), stack.edge()
    stack.worker()
    async with httpx.AsyncClient(timeout=30) as http:
        whole = await sse_frames(http, "POST", first.url + "/v1/chat/completions", json=chat_body(stack.model, 40))
        head = await sse_frames(http, "POST", first.url + "/v1/chat/completions", json=chat_body(stack.model, 40),
                                limit=12)
        stream_id, number = head[-1][0].rsplit(":", 1)
        tail = await sse_frames(http, "GET", f"{second.url}/v1/streams/{stream_id}",
                                headers={"Last-Event-ID": head[-1][0]})
        again = await sse_frames(http, "POST", second.url + "/v1/chat/completions", json={},
                                 headers={"Last-Event-ID": f"{stream_id}:{int(number) + 5}"})
    resumed = head + tail
    assert [int(i.rsplit(":", 1)[1]) for i, _ in resumed] == list(range(len(whole)))

    def content(frames: list[tuple[str, str]]) -> list[str]:  # ids and creation times differ between runs
        return [data.split('"choices":', 1)[-1] for _id, data in frames]

    assert content(resumed) == content(whole)
    assert again == tail[5:]
    await stack.settled()


async def test_a_stream_resumed_on_the_edge_it_began_on_runs_to_its_end(stack: Stack) -> None:
    """The client drops a long stream and resumes it on the same edge: the request that began it (its client gone)
    ends at its next keep-alive without letting the job go or taking the resumed request's events, so the resumed
    stream gets every token once, past the resume window, and nothing stays in flight."""
    edge = stack.edge(keepalive_interval_s=0.5, resume_window_s=2)
    stack.worker()
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", edge.url + "/v1/chat/completions", json=chat_body(stack.model, 200),
                                limit=5)
        stream_id = head[-1][0].rsplit(":", 1)[0]
        tail = await sse_frames(http, "GET", f"{edge.url}/v1/streams/{stream_id}",
                                headers={"Last-Event-ID": head[-1][0]})  # 4 s of tokens at 20 ms each
    frames = head + tail
    assert [int(i.rsplit(":", 1)[1]) for i, _ in frames] == list(range(len(frames)))
    text = "".join(orjson.loads(data)["choices"][0]["delta"].get("content", "") for _id, data in frames
                   if data != "[DONE]" and orjson.loads(data)["choices"])
    assert text == expected(200) and frames[-1][1] == "[DONE]"
    await stack.settled()


async def test_a_stream_of_a_killed_edge_resumes_on_another(stack: Stack) -> None:
    doomed, survivor = stack.edge(), stack.edge()
    stack.worker()
    async with httpx.AsyncClient(timeout=30) as http:
        reading = asyncio.create_task(sse_frames(http, "POST", doomed.url + "/v1/chat/completions",
                                                 json=chat_body(stack.model, 120)))
        deadline = time.monotonic() + 10
        while not any(stack.client.scan_iter(keys.job_record("*"))):  # the job is on its way
            assert time.monotonic() < deadline, "the request did not reach the stack"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # and some tokens are out
        stack.kill(doomed.process)
        with pytest.raises(httpx.HTTPError):
            await reading
        # what the client had is unknown here: resume from the start and check the whole answer
        stream_id = await _running_stream_id(stack)
        frames = await sse_frames(http, "GET", f"{survivor.url}/v1/streams/{stream_id}")
    text = "".join(data.split('"content":"', 1)[1].split('"', 1)[0] for _id, data in frames if '"content":"' in data)
    assert text == expected(120)
    assert frames[-1][1] == "[DONE]"
    await stack.settled()


async def _running_stream_id(stack: Stack) -> str:
    names = [key.decode() for key in stack.client.scan_iter(keys.job_record("*"))]
    assert len(names) == 1
    return names[0].split("{", 1)[1].rstrip("}")


async def test_a_stream_nobody_resumes_is_stopped_after_its_window(stack: Stack) -> None:
    edge = stack.edge(resume_window_s=1)
    worker = stack.worker()
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", edge.url + "/v1/chat/completions", json=chat_body(stack.model, 2000),
                                limit=3)
        left = time.monotonic()
        await stack.settled(timeout_s=6)  # aborted within the window and a supervision round or two
        assert time.monotonic() - left > 0.8
        async with http.stream("GET", f"{edge.url}/v1/streams/{head[0][0].rsplit(':', 1)[0]}",
                               headers={"Last-Event-ID": head[-1][0]}) as response:
            body = (await response.aread()).decode()
        metrics = (await http.get(worker.metrics_url)).text
    assert "stream_abandoned" in body
    assert "outcome=\"aborted\"" in metrics


async def test_a_short_deadline_ends_with_a_timeout_and_frees_the_slot(stack: Stack) -> None:
    edge = stack.edge(request_timeout_s=1)
    stack.worker()
    async with httpx.AsyncClient(timeout=30) as http:
        body = chat_body(stack.model, 2000)
        frames = await sse_frames(http, "POST", edge.url + "/v1/chat/completions", json=body)
        answer = await http.post(edge.url + "/v1/chat/completions", json={**body, "stream": False})
    assert "timeout" in frames[-2][1] and frames[-1][1] == "[DONE]"
    assert answer.status_code == 504 and answer.json()["error"]["type"] == "timeout_error"
    await stack.settled()


async def test_a_job_whose_owners_keep_dying_goes_to_the_dead_letter_stream(stack: Stack) -> None:
    edge = stack.edge()
    first = stack.worker(max_reclaims=0)
    # 30 s of tokens: the first worker is still streaming when the second has started, however slow the machine
    stream = asyncio.create_task(stream_text(edge.url, stack.model, 1500))
    deadline = time.monotonic() + 10
    while stack.pending() != 1:  # the first worker holds the job
        assert time.monotonic() < deadline, "the job was not taken up"
        await asyncio.sleep(0.05)
    stack.worker(max_reclaims=0)
    stack.kill(first.process)
    with pytest.raises(openai.APIError, match="given up"):
        await asyncio.wait_for(stream, 20)
    letters = stack.client.xrange(keys.dead_letters(stack.model))
    assert len(letters) == 1 and b"died" in letters[0][1][b"reason"]
    assert 0 < stack.client.ttl(keys.dead_letters(stack.model)) <= 7 * 24 * 3600  # a prompt is not kept for good
    await stack.settled()


def reading_nothing(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> socket.socket:
    """A client that posts a request (a chat by default) on a socket with a tiny receive window, and reads
    nothing."""
    host, port = url.removeprefix("http://").split(":")
    data = orjson.dumps(body)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (path.encode(), len(data), data))
    return sock


async def test_a_replay_that_redis_fails_under_ends_with_an_error_event(stack: Stack) -> None:
    """A stream replayed from its job's log (read a page at a time, as its client takes them) when Redis dies:
    the client gets the stream's error event and its end, not a second HTTP answer inside the body."""
    edge = stack.edge()
    stack.worker(sim_itl_ms=1, max_model_len=100_000)
    async with httpx.AsyncClient(timeout=30) as http:
        head = await sse_frames(http, "POST", edge.url + "/v1/chat/completions", json=chat_body(stack.model, 3000),
                                headers={"Accept": "text/event-stream"})
    assert head[-1][1] == "[DONE]"
    stream_id = head[0][0].rsplit(":", 1)[0]
    host, port = edge.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(f"GET /v1/streams/{stream_id} HTTP/1.1\r\nHost: x\r\nLast-Event-ID: {stream_id}:0\r\n"
                     "Accept: text/event-stream\r\n\r\n".encode())
        await asyncio.sleep(1)  # the edge wrote what the socket takes, and waits for the client
        stack.redis.kill()
        sock.settimeout(15)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            chunk = await asyncio.to_thread(sock.recv, 65536)
            assert chunk, "the connection closed before the stream's end"
            received += chunk
    finally:
        sock.close()
        stack.redis.start()
    assert received.count(b"HTTP/1.1 ") == 1, received[-400:]  # one answer: the stream's
    tail = received[-2000:].decode(errors="replace")
    assert "redis_unavailable" in tail and "data: [DONE]" in tail, tail


async def test_a_client_that_falls_too_far_behind_is_dropped_and_its_job_stopped(stack: Stack) -> None:
    """A client that reads nothing (a tiny receive window) cannot make the edge hold its stream without bound."""
    edge = stack.edge(max_buffered_events=64, resume_window_s=30)
    worker = stack.worker(sim_itl_ms=1, max_model_len=100_000)
    sock = reading_nothing(edge.url, chat_body(stack.model, 50_000))  # 50 s of tokens
    try:
        started = time.monotonic()
        async with httpx.AsyncClient() as http:
            while "outcome=\"aborted\"" not in (await http.get(worker.metrics_url)).text:
                assert time.monotonic() - started < 10, "the slow client's job was not stopped"
                await asyncio.sleep(0.2)
    finally:
        sock.close()
    assert "fell 64 events behind" in edge.log.read_text()
    await stack.settled()


async def test_a_tenant_s_clients_that_read_nothing_hold_a_bounded_part_of_the_edge(stack: Stack) -> None:
    """Eight clients of one tenant read nothing of long streams, each far from the bound on one stream's events
    and from the write stall: together they pass what an edge holds for a tenant's clients that are behind
    (--max-tenant-behind-bytes, 256 kB here), so those furthest behind are dropped and their jobs stopped within
    seconds, while a client of the same tenant that reads gets its whole answer."""
    edge = stack.edge(max_buffered_events=100_000, write_stall_s=50, max_tenant_behind_bytes=256 * 1024)
    worker = stack.worker(sim_itl_ms=1, max_model_len=100_000, max_num_seqs=16)
    assert (await stream_text(edge.url, stack.model, 2))[1] == 2  # the edge knows the model's worker
    socks = [reading_nothing(edge.url, chat_body(stack.model, 50_000)) for _ in range(8)]  # 50 s of tokens each
    try:
        reading = asyncio.create_task(stream_text(edge.url, stack.model, 3000))
        started = time.monotonic()
        async with httpx.AsyncClient() as http:
            async def aborted() -> float:
                return metric_value((await http.get(worker.metrics_url)).text, "tokenbus_worker_jobs_total",
                                    {"model": stack.model, "outcome": "aborted"})

            while await aborted() < 8:
                assert time.monotonic() - started < 15, f"{await aborted()} of the 8 jobs stopped in 15 s"
                await asyncio.sleep(0.2)
        assert (await reading)[1] == 3000
    finally:
        for sock in socks:
            sock.close()
    assert "of its tenant's" in edge.log.read_text()
    await stack.settled()


async def test_a_tenant_s_clients_that_read_no_whole_answer_hold_a_bounded_part_of_the_edge(stack: Stack) -> None:
    """Whole answers count as streams do: eight clients of one tenant read nothing of 400 kB answers (a long
    prompt echoed), which each wait for the write stall; together they pass --max-tenant-behind-bytes (256 kB
    here), so all but what fits it are dropped within seconds."""
    edge = stack.edge(write_stall_s=50, max_tenant_behind_bytes=256 * 1024)
    stack.worker(max_model_len=1_000_000)
    assert (await stream_text(edge.url, stack.model, 2))[1] == 2  # the edge knows the model's worker
    body = {"model": stack.model, "prompt": "sea " * 100_000, "echo": True, "max_tokens": 1}
    socks = [reading_nothing(edge.url, body, "/v1/completions") for _ in range(8)]
    try:
        started = time.monotonic()
        async with httpx.AsyncClient() as http:
            async def held() -> float:
                return metric_value((await http.get(edge.metrics_url)).text, "tokenbus_edge_requests_in_flight")

            while await held() < 8 and "of its tenant's" not in edge.log.read_text():
                assert time.monotonic() - started < 10, "the answers were not made"
                await asyncio.sleep(0.1)
            while await held() > 2:  # each holds ~140 kB the kernel does not: two would pass the bound
                assert time.monotonic() - started < 15, f"{await held()} unread answers still held"
                await asyncio.sleep(0.2)
    finally:
        for sock in socks:
            sock.close()
    await stack.settled()


async def test_connections_that_send_nothing_cannot_take_an_edge_s_open_files(stack: Stack) -> None:
    """A client (no key needed) opens more connections than the edge has open files and sends nothing on them
    (here the edge's limit is lowered to 512): the edge closes the oldest idle ones as new ones come, so another
    client's stream is still served at once (before, every file was taken and its connection waited, unaccepted,
    until the idle ones timed out)."""
    edge = stack.edge()
    stack.worker()
    assert (await stream_text(edge.url, stack.model, 2))[1] == 2
    resource.prlimit(edge.process.pid, resource.RLIMIT_NOFILE, (512, 512))
    host, port = edge.url.removeprefix("http://").split(":")
    idle = []
    try:
        for _ in range(700):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((host, int(port)))
            idle.append(sock)
        await asyncio.sleep(1)  # the edge accepts them (or, out of files, cannot)
        assert (await asyncio.wait_for(stream_text(edge.url, stack.model, 3), 10))[1] == 3
        async with httpx.AsyncClient() as http:
            text = (await http.get(edge.metrics_url)).text
        closed = metric_value(text, "tokenbus_edge_idle_connections_closed_total")
        assert closed > 0  # those past the limit less the edge's reserve (how many got in depends on the host)
    finally:
        for sock in idle:
            sock.close()
    await stack.settled()


async def test_a_client_that_reads_nothing_is_dropped_at_the_write_stall(stack: Stack) -> None:
    """A stream shorter than the edge's event bound, to a client that reads nothing: a write that waits longer
    than --write-stall-s drops the connection (the edge held the request, and what the client had not read, for
    good: the bound on events behind is never reached)."""
    edge = stack.edge(write_stall_s=2)
    stack.worker(sim_itl_ms=1, max_model_len=100_000)
    assert (await stream_text(edge.url, stack.model, 2))[1] == 2  # the edge knows the model's worker
    sock = reading_nothing(edge.url, chat_body(stack.model, 3000))  # 3 s of tokens, fewer than the events bound
    try:
        async with httpx.AsyncClient() as http:
            async def held() -> float:
                return metric_value((await http.get(edge.metrics_url)).text, "tokenbus_edge_requests_in_flight")

            started = time.monotonic()
            while not await held():
                assert time.monotonic() - started < 10, "the request never started"
                await asyncio.sleep(0.1)
            while await held():  # its job ends within 3 s; what the client did not read would be held for good
                assert time.monotonic() - started < 10, "the client that reads nothing is still held"
                await asyncio.sleep(0.2)
            await stack.settled()
    finally:
        sock.close()


async def test_a_stopped_edge_drains_its_streams_and_exits(stack: Stack) -> None:
    """SIGTERM on an edge under load: it refuses new connections and lets every stream in flight finish."""
    edge = stack.edge(shutdown_grace_s=30)
    stack.worker()
    streams = [asyncio.create_task(stream_text(edge.url, stack.model, 150)) for _ in range(8)]
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # until all eight are in flight
            if metric_value((await http.get(edge.metrics_url)).text, "tokenbus_edge_requests_in_flight") >= 8:
                break
            await asyncio.sleep(0.1)
    edge.process.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(edge.url + "/health")
    results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    assert all(result == (expected(150), 150) for result in results)
    assert await asyncio.to_thread(edge.process.wait, 10) == 0
    await stack.settled()


class ReplyWithholdingProxy:
    """A TCP proxy to Redis that, on a connection where a command carrying `marker` passed, forwards nothing back
    from then on: the command runs, and its reply is lost (as on a network fault after the write)."""

    def __init__(self, upstream: str, marker: bytes) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 6379
        self.marker = marker
        self.withheld = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self.writers += [writer, up_writer]
        withholding = False

        async def up() -> None:
            nonlocal withholding
            while data := await reader.read(65536):
                if self.marker in data and not withholding:
                    withholding, self.withheld = True, self.withheld + 1
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def down() -> None:
            while data := await up_reader.read(65536):
                if not withholding:
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(up(), down(), return_exceptions=True)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:  # the connections' loops read their end and stop
            writer.close()
        await asyncio.sleep(0.1)


async def test_a_job_whose_queue_reply_is_lost_is_stopped_not_run_for_nobody(stack: Stack) -> None:
    """The edge's write of a job reaches Redis, which queues it, but the reply is lost: the client gets its 503 at
    the command's deadline (10 s), and the job, which a worker took at once, is stopped then rather than run to its
    end for nobody (its tokens given back with the refusal, it would run for free too)."""
    worker = stack.worker()
    proxy = ReplyWithholdingProxy(stack.url, b"lost-reply-marker")
    try:
        edge = await asyncio.to_thread(start_edge, await proxy.start(), stack.root, "edge-behind-proxy",
                                       model=stack.model, **FAST_BEATS)
        stack.edges.append(edge)
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=60) as client:
            with pytest.raises(openai.APIStatusError) as refused:  # 2,000 tokens: 40 s of the worker's
                await client.chat.completions.create(model=stack.model, max_tokens=2000, messages=[
                    {"role": "user", "content": "lost-reply-marker"}])
        assert refused.value.status_code == 503 and proxy.withheld == 1
        await stack.settled(timeout_s=10)  # stopped within seconds of the refusal
        async with httpx.AsyncClient() as http:
            text = (await http.get(worker.metrics_url)).text
        assert metric_value(text, "tokenbus_worker_jobs_total", {"outcome": "aborted"}) == 1
        assert metric_value(text, "tokenbus_worker_jobs_total", {"outcome": "finished"}) == 0
    finally:
        await proxy.close()


async def test_a_request_whose_body_arrives_as_its_edge_begins_to_drain_is_answered(stack: Stack) -> None:
    """A drain that begins between a request's head and the rest of its body: the request is still served
    (aiohttp drops what arrives after its close, and the request waited out its body deadline for a 400)."""
    edge = stack.edge(shutdown_grace_s=30, read_timeout_s=5)
    stack.worker()
    body = orjson.dumps({**chat_body(stack.model, 5), "stream": True})
    host, port = edge.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body[:10]))
    await writer.drain()
    await asyncio.sleep(0.3)  # the head is parsed and its handler waits for the body
    edge.process.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    writer.write(body[10:])
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 20)  # the edge closes the connection after it
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert b" t5" in answer and b"data: [DONE]" in answer
    assert await asyncio.to_thread(edge.process.wait, 10) == 0
    await stack.settled()


async def test_a_worker_whose_engine_dies_hands_its_jobs_over_and_exits(stack: Stack) -> None:
    """The engine dies under eight streams (as vLLM's engine core does: every request it holds and gets fails): its
    worker takes no more jobs, hands those it has over and exits 1; their clients see no seam, and no error."""
    edge = stack.edge()
    dying = stack.worker(sim_dies_after_tokens=8 * 150)  # one token a stream a step: 150 tokens into each
    streams = [asyncio.create_task(stream_text(edge.url, stack.model, 400)) for _ in range(8)]
    async with httpx.AsyncClient() as http:  # all eight run on the worker whose engine dies
        deadline = time.monotonic() + 10
        while metric_value((await http.get(dying.metrics_url)).text, "tokenbus_worker_running_jobs") < 8:
            assert time.monotonic() < deadline, "the streams did not reach the worker"
            await asyncio.sleep(0.05)
    stack.worker()
    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert all(result == (expected(400), 400) for result in results)
    assert await asyncio.to_thread(dying.process.wait, 20) == 1
    log = dying.log.read_text()
    assert "the engine died: handing its jobs over" in log and "handed 8 running jobs over" in log
    await stack.settled()


async def test_a_rolling_restart_of_every_edge_and_worker_under_load_loses_nothing(stack: Stack) -> None:
    """Each edge and worker is replaced in turn (SIGTERM, as an orchestrator does) while clients stream; a
    client whose edge is gone before it connects tries another, as behind a load balancer."""
    for _ in range(2):
        stack.edge(shutdown_grace_s=30)
        stack.worker(worker_grace_s=0.5)
    gate = asyncio.Semaphore(16)

    async def one(i: int) -> tuple[str, int]:
        async with gate:
            for attempt in range(20):
                live = [e for e in stack.edges if e.process.poll() is None]
                try:
                    return await stream_text(live[(i + attempt) % len(live)].url, stack.model, 60)
                except openai.APIConnectionError:
                    await asyncio.sleep(0.1)
            raise AssertionError("no edge took the request")

    requests = [asyncio.create_task(one(i)) for i in range(96)]
    old = [*stack.edges, *stack.workers]
    for process in old:
        await asyncio.sleep(0.7)
        replacement = stack.edge(shutdown_grace_s=30) if process in stack.edges else stack.worker(worker_grace_s=0.5)
        assert replacement is not None
        process.process.send_signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*requests), 120)
    assert sum(result == (expected(60), 60) for result in results) == 96
    # each drains for at most its 30 s grace, then exits cleanly (an edge's shutdown is bounded: grace + 10 s)
    for process in old:
        await exits_cleanly(process, 60)
    await stack.settled()


async def test_a_stream_whose_only_worker_dies_ends_with_worker_lost_within_seconds(stack: Stack) -> None:
    edge = stack.edge()
    only = stack.worker()
    stream = await streaming(edge.url, stack.model, 2000)
    stack.kill(only.process)
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match="died") as caught:
        await asyncio.wait_for(stream, 15)
    assert time.monotonic() - killed < 10
    assert caught.value.code == "worker_lost"
    stack.worker()  # the next worker claims the dead one's entry and, as its client gave up, drops it
    await stack.settled()


async def test_a_request_whose_only_worker_dies_before_starting_it_ends_with_queue_timeout_not_at_its_deadline(
        stack: Stack) -> None:
    """A job queued behind the only worker's one busy slot, then the worker is killed with no other to take it:
    its client hears that no worker started it once the queue timeout (and the time a start takes to be heard
    of) is past, not after the request's 600 s; the next worker to come does not start it."""
    edge = stack.edge(queue_timeout_s=1)
    doomed = stack.worker(max_num_seqs=1)
    first = await streaming(edge.url, stack.model, 1000)  # holds the only slot
    asked = time.monotonic()
    queued = asyncio.create_task(stream_text(edge.url, stack.model, 20))
    async with httpx.AsyncClient() as http:
        deadline = time.monotonic() + 10
        while metric_value((await http.get(edge.metrics_url)).text, "tokenbus_edge_requests_in_flight") < 2:
            assert time.monotonic() < deadline, "the second request did not reach the edge"
            await asyncio.sleep(0.05)
    stack.kill(doomed.process)
    with pytest.raises(openai.APIError, match="queue timeout") as caught:
        await asyncio.wait_for(queued, 30)
    assert caught.value.code == "queue_timeout"
    assert time.monotonic() - asked < 1 + bus.START_NOTICE_S + 3
    with pytest.raises(openai.APIError):
        await asyncio.wait_for(first, 30)  # its worker died: worker_lost
    stack.worker()
    await stack.settled()  # the next worker drops the job it finds cancelled


async def test_a_request_no_busy_worker_starts_in_time_ends_with_queue_timeout_and_leaves_the_queue(
        stack: Stack) -> None:
    """One slot, held by a long stream: a second request waits in the backlog; once the queue timeout is past its
    client hears so while the first still streams, and its job leaves the queue without ever running."""
    edge = stack.edge(queue_timeout_s=1)
    worker = stack.worker(max_num_seqs=1)
    first = await streaming(edge.url, stack.model, 1000)  # 20 s of tokens
    asked = time.monotonic()
    with pytest.raises(openai.APIError, match="queue timeout") as caught:
        await asyncio.wait_for(stream_text(edge.url, stack.model, 5), 30)
    assert caught.value.code == "queue_timeout"
    assert time.monotonic() - asked < 1 + bus.START_NOTICE_S + 3
    assert not first.done()
    assert stack.on_streams() == 1  # the first's entry alone: the second was withdrawn from the backlog
    first.cancel()
    await stack.settled()
    async with httpx.AsyncClient() as http:
        text = (await http.get(worker.metrics_url)).text
    assert metric_value(text, "tokenbus_worker_jobs_total") == 1  # the first, cancelled; the second never taken


async def test_a_model_whose_workers_are_all_gone_is_a_503_to_retry_not_a_404(stack: Stack) -> None:
    """While the model's only worker restarts, its requests get a 503 with Retry-After (clients and SDKs retry
    it), not the 404 of a model that does not exist; a model never served stays a 404; the new worker serves."""
    edge = stack.edge()
    only = stack.worker()
    assert (await stream_text(edge.url, stack.model, 2))[0] == expected(2)  # the edge has seen it live
    stack.kill(only.process)
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        await _no_live_worker(http, edge.metrics_url)
        gone = await http.post("/v1/chat/completions", json={**chat_body(stack.model, 5), "stream": False})
        assert gone.status_code == 503 and gone.headers["Retry-After"], gone.text
        assert gone.json()["error"]["code"] == "model_unavailable"
        tgi = await http.post("/generate", json={"inputs": "count", "model": stack.model})
        assert tgi.status_code == 503 and "error" in tgi.json()
        unknown = await http.post("/v1/chat/completions", json={**chat_body("no-such-model", 5), "stream": False})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    stack.worker()
    assert (await stream_text(edge.url, stack.model, 5))[0] == expected(5)
    await stack.settled()


async def _no_live_worker(http: httpx.AsyncClient, edge_metrics_url: str) -> None:
    """Waits (10 s at most) until the edge counts no live worker: a request sent before would be queued."""
    deadline = time.monotonic() + 10
    while metric_value((await http.get(edge_metrics_url)).text, "tokenbus_edge_live_workers") > 0:
        assert time.monotonic() < deadline, "the edge still counts a live worker"
        await asyncio.sleep(0.2)


async def test_a_structured_stream_whose_worker_dies_ends_with_worker_lost_never_unconstrained(stack: Stack) -> None:
    """A job under a JSON constraint cannot continue mid-answer elsewhere (the grammar would start over): its
    stream ends with worker_lost instead; one that had sent nothing yet simply runs on the next worker."""
    edge = stack.edge()
    doomed = stack.worker()
    stream = await streaming(edge.url, stack.model, 400, response_format={"type": "json_object"})
    stack.kill(doomed.process)
    stack.worker()
    with pytest.raises(openai.APIError, match="structured output") as caught:
        await asyncio.wait_for(stream, 30)
    assert caught.value.code == "worker_lost"
    await stack.settled()


async def test_a_stream_with_tools_whose_worker_dies_continues_with_its_parser_where_it_was(stack: Stack) -> None:
    """A job whose text goes through a tool parser (tool_choice auto) continues on the next worker, its parser
    brought back from the tokens already sent: no seam in the content (the simulated text holds no calls)."""
    edge = stack.edge()
    doomed = stack.worker()
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    stream = await streaming(edge.url, stack.model, 400, tools=tools)
    stack.kill(doomed.process)
    survivor = stack.worker()
    assert await asyncio.wait_for(stream, 30) == (expected(400), 400)
    assert "continuing job" in survivor.log.read_text()
    await stack.settled()
