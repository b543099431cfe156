"""A job's event log in Redis: what the owner appends with each write of its events, what a resumed stream
replays and what a worker that takes the job over continues from. Bounded in length, and expiring."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from shared.protocol import bus, keys


def parse(entries: Any) -> list[bus.Event]:
    """The events of XRANGE entries ([id, {field: payload}] or [id, [field, payload]]), in position order: a
    worker writes tokens again when the replies of their write show a failure, and by then a later write may
    have landed (the sort is stable: one position written twice, by an owner and a former one, keeps the order
    written)."""
    events: list[bus.Event] = []
    for _entry_id, fields in entries or ():
        payload = fields.get(bus.EVENTS_FIELD) if isinstance(fields, dict) else fields[1]
        if payload is not None:
            events.extend(bus.decode_events(payload))
    events.sort(key=_position)
    return events


def _position(event: bus.Event) -> int:
    return event.seq


PAGE_ENTRIES = 256
"""Entries (one owner's write each: a step's events of the job) one read of a log takes."""


async def read_page(redis: aioredis.Redis, job_id: str, after: str) -> tuple[list[bus.Event], str, bool]:
    """The events of the log's entries after entry id `after` ("" for the start), at most PAGE_ENTRIES of them,
    in position order within the page; the id of the last entry read, and whether more may follow."""
    entries = await redis.xrange(keys.job_log(job_id), min=f"({after}" if after else "-", count=PAGE_ENTRIES)
    if not entries:
        return [], after, False
    last = entries[-1][0]
    return parse(entries), last.decode() if isinstance(last, bytes) else str(last), len(entries) == PAGE_ENTRIES
