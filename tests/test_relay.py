"""How one request waits for its events: in order, errors after the events before them, deadlines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from services.edge.jobevents import LOG_PAGE_EVENTS, JobEvents
from shared.protocol import bus, sequence
from shared.protocol.errors import ContextLengthExceeded, RequestTimeout, StreamAbandoned, WorkerLost

TOKENS = [bus.Tokens(job="j", text=t, token_ids=[i], seq=i) for i, t in enumerate("abc")]
FINAL = bus.Final(job="j", prompt_tokens=1, completion_tokens=3, seq=3)


async def test_events_come_in_order_and_end_with_final() -> None:
    events = JobEvents("j", time.monotonic() + 5)
    for event in [*TOKENS, FINAL]:
        events.offer(event)
    assert await events.next() == TOKENS[0]
    rest = events.ready()
    assert [type(e) for e in rest] == [bus.Tokens, bus.Tokens, bus.Final]
    assert events.finished


async def test_an_error_after_tokens_waits_until_they_are_out() -> None:
    events = JobEvents("j", time.monotonic() + 5)
    events.offer(TOKENS[0])
    events.offer(bus.Error(job="j", kind="ContextLengthExceeded", message="long", param="messages", seq=1))
    assert events.ready() == [TOKENS[0]]
    with pytest.raises(ContextLengthExceeded):
        await events.next()


async def test_a_waiter_wakes_for_an_event_or_a_tick() -> None:
    events = JobEvents("j", time.monotonic() + 5)
    waiting = asyncio.create_task(events.next())
    await asyncio.sleep(0)
    events.wake()  # a tick: nothing arrived
    assert await waiting is None
    waiting = asyncio.create_task(events.next())
    await asyncio.sleep(0)
    events.offer(TOKENS[0])
    assert await waiting == TOKENS[0]


async def test_a_passed_deadline_raises() -> None:
    events = JobEvents("j", time.monotonic() - 1)
    with pytest.raises(RequestTimeout):
        await events.next()


def test_a_bad_batch_is_skipped_and_the_next_one_delivered() -> None:
    from services.edge.relay import EventRelay

    relay = EventRelay(None, None, "s")  # dispatch needs no Redis
    events = relay.register("j", time.monotonic() + 5)
    relay.dispatch(b"not msgpack")
    relay.dispatch(bus.encode_events([TOKENS[0]]))
    assert events.ready() == [TOKENS[0]]


async def test_a_first_answer_goes_out_before_the_tokens_of_streams_already_flowing() -> None:
    from services.edge.relay import EventRelay

    relay = EventRelay(None, None, "s")  # dispatch needs no Redis
    written: list[str] = []
    flowing, fresh, gone = (relay.register(job, time.monotonic() + 5) for job in ("flowing", "fresh", "gone"))
    def sink_of(job: str) -> Callable[[bus.Event], bool]:
        def write(event: bus.Event) -> bool:  # straight to its client
            written.append(f"{job} {event.seq}")
            return True
        return write

    flowing.sink, gone.sink = sink_of("flowing"), sink_of("gone")

    async def first_answer() -> None:
        event = await fresh.next()
        written.append(f"fresh {event.seq if event else None}")
        relay.unregister(gone)  # meanwhile another request ended

    streaming = [asyncio.create_task(events.next()) for events in (flowing, gone)]  # the sinks take their tokens
    answering = asyncio.create_task(first_answer())
    await asyncio.sleep(0)
    step = [bus.Tokens(job=job, text="x", token_ids=[1], seq=seq) for seq in (0, 1) for job in ("flowing", "gone")]
    relay.dispatch(bus.encode_events([*step, bus.Tokens(job="fresh", text="x", token_ids=[1], seq=0)]))
    assert written == []  # nothing before the woken request has run
    await answering
    await asyncio.sleep(0)
    assert written == ["fresh 0", "flowing 0", "flowing 1"]  # and nothing for the request that ended
    assert not gone.buffer
    for task in streaming:
        task.cancel()


async def test_a_flowing_stream_keeps_its_order_when_one_read_brings_several_steps() -> None:
    """A read can hold two steps: the first one's flowing tokens wait for a woken request, so the second's wait
    behind them instead of overtaking them."""
    from services.edge.relay import EventRelay

    relay = EventRelay(None, None, "s")
    written: list[int] = []
    flowing, fresh = relay.register("flowing", time.monotonic() + 5), relay.register("fresh", time.monotonic() + 5)

    def write(event: bus.Event) -> bool:
        written.append(event.seq)
        return True

    flowing.sink = write
    streaming = asyncio.create_task(flowing.next())
    answering = asyncio.create_task(fresh.next())
    await asyncio.sleep(0)
    relay.dispatch(bus.encode_events([bus.Tokens(job=job, text="x", token_ids=[1], seq=0)
                                      for job in ("flowing", "fresh")]))
    relay.dispatch(bus.encode_events([bus.Tokens(job="flowing", text="y", token_ids=[2], seq=1)]))
    await answering
    await asyncio.sleep(0)
    assert written == [0, 1]
    streaming.cancel()


async def test_a_sink_takes_events_only_while_the_request_waits_with_nothing_queued() -> None:
    events = JobEvents("j", time.monotonic() + 5)
    taken: list[bus.Event] = []

    def sink(event: bus.Event) -> bool:
        if isinstance(event, bus.Tokens):
            taken.append(event)
            return True
        return False

    events.sink = sink
    events.offer(TOKENS[0])  # nobody waits yet: the request is busy, so it queues
    assert taken == [] and events.ready() == [TOKENS[0]]
    waiting = asyncio.create_task(events.next())
    await asyncio.sleep(0)
    events.offer(TOKENS[1])  # the request waits and nothing is queued: taken on the spot
    prompt = bus.Prompt(job="j", index=0, token_ids=[1], seq=2)
    events.offer(prompt)  # declined: queued, and the request wakes for it
    events.offer(FINAL)  # something is queued now: it queues behind, keeping the order
    assert taken == [TOKENS[1]]
    assert await waiting == prompt
    assert events.ready() == [FINAL]
    assert events.finished


async def test_a_sink_that_fails_is_dropped_and_its_event_queued() -> None:
    events = JobEvents("j", time.monotonic() + 5)

    def broken(event: bus.Event) -> bool:
        raise RuntimeError("bug")

    events.sink = broken
    waiting = asyncio.create_task(events.next())
    await asyncio.sleep(0)
    events.offer(TOKENS[0])
    assert await waiting == TOKENS[0]
    assert events.sink is None


async def test_the_ticker_wakes_only_requests_with_something_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.edge import relay as relay_module

    monkeypatch.setattr(relay_module, "TICK_S", 0.01)
    relay = relay_module.EventRelay(None, None, "s")  # ticking needs no Redis
    flowing, gone, unwatched = (relay.register(name, time.monotonic() + 5) for name in ("flowing", "gone", "plain"))
    flowing.watch = lambda: False  # its tokens go out directly: nothing to check
    gone.watch = lambda: True  # e.g. its client left
    waits = {events.job_id: asyncio.create_task(events.next()) for events in (flowing, gone, unwatched)}
    ticker = asyncio.create_task(relay.tick())
    try:
        done, _pending = await asyncio.wait(waits.values(), timeout=0.2)
        assert done == {waits["gone"], waits["plain"]}
        assert not waits["flowing"].done()
        flowing.deadline = time.monotonic()  # a passed deadline always wakes it
        assert await asyncio.wait_for(waits["flowing"], 1) is None
    finally:
        ticker.cancel()


def _owned(epoch: int, start: int, *texts: str, worker: str = "w") -> list[bus.Event]:
    """A Started at `start` under `epoch`, then one token event per text."""
    started: list[bus.Event] = [bus.Started(job="j", worker=worker, seq=start, epoch=epoch)]
    return started + [bus.Tokens(job="j", text=t, token_ids=[i], seq=start + 1 + i, epoch=epoch)
                      for i, t in enumerate(texts)]


async def test_a_job_taken_over_continues_without_repeats_and_drops_the_old_owner() -> None:
    events = JobEvents("j", time.monotonic() + 5)
    first, second = _owned(1, 0, "a", "b", "c"), _owned(2, 3, "c2", "d", worker="w2")
    for event in [*first[:3], *first[1:3], *second, first[3]]:  # repeats, then a late event of the old owner
        events.offer(event)
    assert [e.text for e in events.ready() if isinstance(e, bus.Tokens)] == ["a", "b", "c2", "d"]
    assert events.owner == "w2"


async def test_a_gap_is_filled_from_the_log_before_later_events() -> None:
    log = _owned(1, 0, "a", "b", "c", "d")

    async def read_log(job_id: str, after: str) -> tuple[list[bus.Event], str, bool]:
        return (log, "1-0", False) if not after else ([], after, False)

    events = JobEvents("j", time.monotonic() + 5, read_log)
    events.offer(log[0])
    events.offer(log[1])
    events.offer(log[4])  # "d": "b" and "c" never reached this edge
    assert [e.text for e in [await events.next(), *events.ready()] if isinstance(e, bus.Tokens)] == ["a"]
    assert [e.text for e in [await events.next(), *events.ready()] if isinstance(e, bus.Tokens)] == ["b", "c", "d"]


async def test_a_new_owner_that_starts_behind_what_was_delivered_ends_the_stream() -> None:
    events = JobEvents("j", time.monotonic() + 5)
    for event in [*_owned(1, 0, "a", "b", "c"), *_owned(2, 2, "x")]:
        events.offer(event)
    assert [e.text for e in events.ready() if isinstance(e, bus.Tokens)] == ["a", "b", "c"]
    with pytest.raises(WorkerLost):
        await events.next()


def _paged(entries: list[list[bus.Event]], page: int, reads: list[int]) -> Callable[..., Any]:
    """A log reader over `entries` (one owner's write each), `page` entries a read; records each read's start."""
    async def read_log(job_id: str, after: str) -> tuple[list[bus.Event], str, bool]:
        start = int(after) if after else 0
        reads.append(start)
        chunk = entries[start:start + page]
        events = sorted((e for entry in chunk for e in entry), key=lambda e: e.seq)
        return events, str(start + len(chunk)), start + page < len(entries)

    return read_log


async def test_a_resumed_stream_reads_its_log_a_page_at_a_time_as_its_client_takes_it() -> None:
    texts = [f"t{i}" for i in range(3000)]
    log = [*_owned(1, 0, *texts), bus.Final(job="j", prompt_tokens=1, completion_tokens=3000, seq=3001, epoch=1)]
    reads: list[int] = []
    events = JobEvents("j", time.monotonic() + 5, _paged([[e] for e in log], 256, reads))
    events.gap_at = 0  # as a resumed stream starts
    got: list[str] = []
    most = 0
    while (event := await events.next()) is not None and not isinstance(event, bus.Final):
        most = max(most, len(events.buffer))
        if isinstance(event, bus.Tokens):
            got.append(event.text)
    assert got == texts and isinstance(event, bus.Final)
    assert most < LOG_PAGE_EVENTS + 256  # never the whole log at once
    assert len(reads) == len(set(reads)) == -(-len(log) // 256)  # each entry read once


async def test_a_write_repeated_after_a_later_one_is_taken_in_order_across_pages() -> None:
    tokens = _owned(1, 0, "a", "b", "c", "d", "e")
    entries = [[tokens[0]], [tokens[1]], [tokens[3]], [tokens[4]], [tokens[5]], [tokens[2]]]  # "b" again at the end
    events = JobEvents("j", time.monotonic() + 5, _paged(entries, 2, []))
    events.gap_at = 0
    got = []
    while (event := await events.next()) is not None:
        got += [e.text for e in [event, *events.ready()] if isinstance(e, bus.Tokens)]
        if got == ["a", "b", "c", "d", "e"]:
            break
    assert got == ["a", "b", "c", "d", "e"]


async def test_a_cancelled_job_whose_log_ends_without_its_end_is_abandoned() -> None:
    events = JobEvents("j", time.monotonic() + 5, _paged([[e] for e in _owned(1, 0, "a")], 256, []))
    events.gap_at, events.abandoned = 0, True
    assert [e.text for e in [await events.next(), *events.ready()] if isinstance(e, bus.Tokens)] == ["a"]
    with pytest.raises(StreamAbandoned):
        await events.next()


async def test_a_second_request_of_a_job_shelves_the_first_until_it_ends() -> None:
    """A stream resumed on the edge it began on: the resumed request reads the job's events; the one it shelved
    ending meanwhile takes nothing from it; once the resumed one ends, the shelved one gets the job back and reads
    what it missed from the log."""
    from services.edge.relay import EventRelay

    relay = EventRelay(None, None, "s")  # dispatch needs no Redis
    first = relay.register("j", time.monotonic() + 5)
    second = relay.register("j", time.monotonic() + 5)
    relay.dispatch(bus.encode_events([TOKENS[0]]))
    assert second.ready() == [TOKENS[0]] and not first.buffer
    assert relay.reads(second) and not relay.reads(first)
    third = relay.register("j", time.monotonic() + 5)
    relay.unregister(second)  # a shelved request ended: the job stays the last one's
    assert relay.reads(third) and relay.shelved == {"j": [first]}
    relay.unregister(third)
    assert relay.reads(first) and first.log_unread and relay.shelved == {}
    relay.unregister(first)
    assert relay.jobs == {} and not relay.busy.is_set()


def test_a_log_read_a_page_at_a_time_is_taken_as_it_is_whole() -> None:
    """A write repeated after a later one landed may fall on the next page: its positions are taken in order there;
    a log whose start is missing (trimmed) stops at once, as `in_order` stops it read whole."""
    started = bus.Started(job="j", worker="w", seq=0)
    tokens = [bus.Tokens(job="j", text=str(i), token_ids=[i], seq=i) for i in range(1, 5)]
    ordered = sequence.InOrder(hold=4)
    taken = ordered.take([started, tokens[0], tokens[2], tokens[3]]) + ordered.take([tokens[1], tokens[2], FINAL])
    assert taken == [started, *tokens[:4]] and not ordered.stopped
    whole, conflict = sequence.in_order([started, *tokens[:4]])
    assert whole == taken and not conflict
    trimmed = sequence.InOrder(hold=2)
    assert trimmed.take(tokens) == [] and trimmed.stopped
