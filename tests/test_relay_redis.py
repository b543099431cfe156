"""The edge's relay against a real Redis, fed by the worker's own publisher: what its subscription missed
reaches the waiting requests from their jobs' logs, and a Redis that stops answering is noticed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from services.edge import relay as relay_module
from services.edge.jobevents import JobEvents
from services.edge.relay import EventRelay, Timing
from services.supervisor import RedisServer
from services.worker.publisher import EventPublisher
from shared.protocol import bus, keys
from shared.redisio import clients as redis_clients

LOG_MAX = 100


async def _subscribed(relay: EventRelay, wait_s: float = 5.0) -> None:
    deadline = time.monotonic() + wait_s
    while relay.connection is None or relay.down_since is not None or not await _listening(relay):
        assert time.monotonic() < deadline, "the relay did not subscribe"
        await asyncio.sleep(0.02)


async def _listening(relay: EventRelay) -> bool:
    counts = await relay.commands.execute_command("PUBSUB", "SHARDNUMSUB", relay.channel)
    return int(counts[1]) == 1


@pytest.fixture
async def relay(redis_url: str) -> AsyncIterator[EventRelay]:
    commands = redis_clients.pooled(redis_url, "test-relay", 4)
    reader = redis_clients.dedicated(redis_url, "test-relay-reader")
    made = EventRelay(reader, commands, keys.events_channel(uuid.uuid4().hex), Timing(redis_down_after_s=0.5))
    running = asyncio.create_task(made.run())
    await _subscribed(made)
    yield made
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    await reader.aclose()
    await commands.aclose()


async def _all_of(events: JobEvents, wait_s: float) -> list[bus.Output]:
    out: list[bus.Output] = []
    async with asyncio.timeout(wait_s):
        while not events.finished:
            if (event := await events.next()) is not None:
                out += [event, *events.ready()]
    return out


async def test_events_published_while_the_subscription_was_down_arrive_from_the_log(
    relay: EventRelay, redis_client: redis.Redis, redis_url: str
) -> None:
    """Redis drops the edge's subscriber (as on a network blip) while the worker writes a job's last tokens and
    its Final: nothing comes after them to show a gap, yet the request gets every one, in order, once the relay
    has subscribed again."""
    job = f"job-{uuid.uuid4().hex}"
    events = relay.register(job, time.monotonic() + 30)
    publisher = EventPublisher(redis_clients.dedicated(redis_url, "test-relay-worker"), LOG_MAX)
    tokens = [bus.Tokens(job=job, text=t, token_ids=[i], seq=1 + i) for i, t in enumerate("abcd")]
    try:
        publisher.publish(relay.channel, bus.Started(job=job, worker="w", seq=0))
        publisher.publish(relay.channel, tokens[0])
        await publisher.flush()
        assert redis_client.client_kill_filter(_type="pubsub") >= 1
        for event in [*tokens[1:], bus.Final(job=job, prompt_tokens=1, completion_tokens=4, seq=5)]:
            publisher.publish(relay.channel, event)
        await publisher.flush()
        got = await _all_of(events, wait_s=10)
    finally:
        await publisher.redis.aclose()
    assert [e.text for e in got if isinstance(e, bus.Tokens)] == ["a", "b", "c", "d"]
    assert isinstance(got[-1], bus.Final) and len(got) == 5


async def test_a_quiet_subscription_is_pinged_and_keeps_its_connection(
    relay: EventRelay, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscription with nothing to carry is asked for a PONG after each quiet spell, and answering keeps it:
    the same connection, no outage, for many spells in a row."""
    monkeypatch.setattr(relay_module, "PING_AFTER_S", 0.1)
    monkeypatch.setattr(relay_module, "PONG_WAIT_S", 0.1)
    failures: list[Exception] = []
    monkeypatch.setattr(relay, "_failed", failures.append)
    connection = relay.connection
    def pings() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_ping", {}).get("calls", 0))

    before, waited = pings(), time.monotonic()
    while pings() - before < 3:  # the first spell is the default one, 2 s on its beat (up to 4 s): then 0.1 s
        assert time.monotonic() - waited < 6, f"{pings() - before} pings in 6 s"
        await asyncio.sleep(0.1)
    assert not failures and relay.connection is connection and relay.down_since is None


async def test_a_redis_that_stops_answering_is_noticed_by_a_quiet_subscription(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped (not killed) Redis keeps its sockets open: the quiet subscription's PING goes unanswered, the
    relay calls Redis down, and once Redis runs again it subscribes again and says so."""
    monkeypatch.setattr(relay_module, "PING_AFTER_S", 0.3)
    monkeypatch.setattr(relay_module, "PONG_WAIT_S", 0.3)
    server = RedisServer(str(tmp_path))
    url = server.start()
    commands = redis_clients.pooled(url, "test-relay-stopped", 2)
    reader = redis_clients.dedicated(url, "test-relay-stopped-reader")
    relay = EventRelay(reader, commands, keys.events_channel(uuid.uuid4().hex), Timing(redis_down_after_s=0.5))
    running = asyncio.create_task(relay.run())
    assert server.proc is not None
    try:
        await _subscribed(relay)
        os.kill(server.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not relay.redis_down():
            assert time.monotonic() - stopped < 5, "a stopped Redis went unnoticed"
            await asyncio.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGCONT)
        await _subscribed(relay, wait_s=10)
        assert not relay.redis_down()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await reader.aclose()
        await commands.aclose()
        server.stop()


async def test_while_events_flow_the_reader_looks_at_the_waiting_requests_and_the_ticker_sleeps(
    relay: EventRelay, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rounds over the waiting requests (deadlines, clients) ride the reader's wakes while tokens arrive: the
    ticker, whose every wake costs the edge one, wakes only once they stop."""
    monkeypatch.setattr(relay_module, "TICK_S", 0.05)
    job = f"job-{uuid.uuid4().hex}"
    events = relay.register(job, time.monotonic() + 30)
    rounds: list[str] = []
    do_round = relay._round

    def counted() -> None:
        rounds.append("ticker" if relay.backstop is None else "reader")
        do_round()

    monkeypatch.setattr(relay, "_round", counted)
    publisher = EventPublisher(redis_clients.dedicated(redis_url, "test-relay-worker"), LOG_MAX)
    ticker = asyncio.create_task(relay.tick())
    try:
        publisher.publish(relay.channel, bus.Started(job=job, worker="w", seq=0))
        for i in range(30):  # 0.6 s of tokens, one every 20 ms
            publisher.publish(relay.channel, bus.Tokens(job=job, text="x", token_ids=[i], seq=1 + i))
            await publisher.flush()
            await asyncio.sleep(0.02)
        flowing = list(rounds)
        await asyncio.sleep(0.5)
    finally:
        ticker.cancel()
        await publisher.redis.aclose()
    assert flowing.count("reader") >= 6 and "ticker" not in flowing
    assert rounds[len(flowing):].count("ticker") >= 3  # quiet: every 2 * TICK_S
    assert len(events.ready()) == 30


async def test_a_job_log_is_read_in_pages_each_entry_once(redis_url: str) -> None:
    from shared.protocol import joblog

    job_id = f"paged-{uuid.uuid4().hex}"
    client = redis_clients.pooled(redis_url, "test", 1)
    try:
        for seq in range(joblog.PAGE_ENTRIES * 2 + 10):
            token = bus.Tokens(job=job_id, text=str(seq), token_ids=[seq], seq=seq, epoch=1)
            await client.xadd(keys.job_log(job_id), {bus.EVENTS_FIELD: bus.encode_events([token])})
        seen: list[int] = []
        after, more, pages = "", True, 0
        while more:
            events, after, more = await joblog.read_page(client, job_id, after)
            assert len(events) <= joblog.PAGE_ENTRIES
            seen += [event.seq for event in events]
            pages += 1
        assert seen == list(range(joblog.PAGE_ENTRIES * 2 + 10)) and pages == 3
        assert await joblog.read_page(client, job_id, after) == ([], after, False)
    finally:
        await client.aclose()


async def test_one_write_of_large_answers_for_an_edge_does_not_cost_it_its_subscription(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis drops a subscriber whose unsent messages pass its pubsub output buffer limit (32 MB by default; 4 MB
    here, so that three answers show it rather than eleven): a worker finishing three 2,048-input embeddings jobs
    of 384 dimensions (3 MB of vectors each) for one edge in one write, beside another job's tokens, keeps the
    edge's subscription (the same connection, no outage), and each request gets every vector, in order."""
    server = RedisServer(str(tmp_path))
    url = server.start()
    commands = redis_clients.pooled(url, "test-relay-large", 4)
    reader = redis_clients.dedicated(url, "test-relay-large-reader")
    await commands.config_set("client-output-buffer-limit", "pubsub 4mb 2mb 60")
    relay = EventRelay(reader, commands, keys.events_channel(uuid.uuid4().hex), Timing(redis_down_after_s=0.5))
    failures: list[Exception] = []
    monkeypatch.setattr(relay, "_failed", failures.append)
    running = asyncio.create_task(relay.run())
    publisher = EventPublisher(redis_clients.dedicated(url, "test-relay-large-worker"), LOG_MAX)
    jobs = [f"embed-{i}-{uuid.uuid4().hex}" for i in range(3)]
    chat = f"chat-{uuid.uuid4().hex}"
    try:
        await _subscribed(relay)
        connection = relay.connection
        waiting = {job: relay.register(job, time.monotonic() + 30) for job in [*jobs, chat]}
        for job in [*jobs, chat]:
            publisher.publish(relay.channel, bus.Started(job=job, worker="w", seq=0))
        for n, job in enumerate(jobs):
            for index in range(2048):
                vector = bus.pack_vector([float(n * 10_000 + index)] * 384)
                publisher.publish(relay.channel, bus.Embedding(job=job, seq=1 + index, index=index, prompt_tokens=3,
                                                               packed=vector))
            publisher.publish(relay.channel, bus.Final(job=job, seq=2049, prompt_tokens=6144, completion_tokens=0))
        publisher.publish(relay.channel, bus.Tokens(job=chat, text="hi", token_ids=[1], seq=1))
        publisher.publish(relay.channel, bus.Final(job=chat, seq=2, prompt_tokens=1, completion_tokens=1))
        await publisher.flush()
        got = {job: await _all_of(events, wait_s=10) for job, events in waiting.items()}
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await publisher.redis.aclose()
        await reader.aclose()
        await commands.aclose()
        server.stop()
    assert not failures and relay.connection is connection
    for n, job in enumerate(jobs):
        vectors = [event for event in got[job] if isinstance(event, bus.Embedding)]
        assert [event.index for event in vectors] == list(range(2048))
        assert all(event.values() == [float(n * 10_000 + event.index)] * 384 for event in vectors)
        assert isinstance(got[job][-1], bus.Final)
    assert [type(event) for event in got[chat]] == [bus.Tokens, bus.Final]
