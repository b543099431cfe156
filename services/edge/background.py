"""Background responses (`background: true` on POST /v1/responses, as OpenAI defines them): answered at once,
queued; followed to their end by the edge that took them, which stores the answer; rendered again from their
job's log by any edge while they run (a retrieve, a stream from any sequence number) and cancelled by any.

The job's log is the record: it holds every event from sequence 0 for --background-ttl-s after the job's end
(charged to the tenant's storage), so no edge has to live as long as the job: whichever edge reads an ended
one first and finds no stored answer stores it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

import msgspec
from aiohttp import web

from services.edge import framing, pump
from services.edge.auth import caller_of
from services.edge.conversation_store import keep_turn
from services.edge.formats.planners import Arrival
from services.edge.formats.response_render import ResponsesRenderer
from services.edge.plans import PLANNERS, Plan, StreamRecord, decode_record
from services.edge.redis_boundary import redis_boundary
from services.edge.state import ADMITTER, CONVERSATIONS, GATEWAY, REDIS, SETTINGS, STORE
from shared.protocol import bus, joblog, keys, sequence
from shared.protocol.errors import InvalidRequest, NotFound, StreamAbandoned, from_kind
from shared.runtime import metrics
from shared.runtime.background import cancel_and_wait

log = logging.getLogger(__name__)

TASKS = web.AppKey("background_followers", set[asyncio.Task[None]])
"""The tasks following this edge's background responses to their end."""

SNAPSHOT_FRESH_S = 1.0
"""How long a rendering of a running background response answers the retrieves of it: a client polling in a loop
costs the edge one read of the job's log (up to --replay-max-events entries), one planning of its request and one
rendering a second, not one a poll; a poll sees the response at most this old."""
MAX_SNAPSHOTS = 1024
BAR_GRACE_MS = 60_000
"""How long after its job's deadline a deleted running response's id stays barred from being stored: its answer
reaches the edge that stores it soon after the job ends, at the latest."""


class Snapshots:
    """This edge's latest renderings of running background responses, by id (the caller's ownership is checked
    before one is handed out)."""

    def __init__(self) -> None:
        self.kept: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def fresh(self, response_id: str) -> bytes | None:
        found = self.kept.get(response_id)
        return found[1] if found is not None and time.monotonic() < found[0] else None

    def keep(self, response_id: str, body: bytes) -> None:
        self.kept[response_id] = (time.monotonic() + SNAPSHOT_FRESH_S, body)
        self.kept.move_to_end(response_id)
        while len(self.kept) > MAX_SNAPSHOTS:
            self.kept.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self.kept.pop(response_id, None)


SNAPSHOTS = web.AppKey("background_snapshots", Snapshots)


async def keep_first(app: web.Application, tenant: str, renderer: ResponsesRenderer, model: str) -> None:
    """Stores an ended background response's answer (and its conversation's turn) unless one is stored already
    (a cancel's, or another edge's), or the response was deleted (its id is barred: see `forget`), and counts
    how it ended, once."""
    turn = renderer.to_store()
    if turn is None:
        return
    if await keep_turn(app[STORE], app[CONVERSATIONS], tenant, turn):
        metrics.BACKGROUND.labels(model, renderer.status).inc()


async def start(request: web.Request, plan: Plan, deadline: float, record: tuple[str, bytes, int],
                lease: str) -> web.Response:
    """Queues the job (or raises its refusal) and answers with the response, queued; a task of this edge follows
    the job to its end, stores its answer and gives its concurrency lease back then."""
    queued: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(_follow(request, plan, deadline, record, lease, queued))
    followers = request.app[TASKS]
    followers.add(task)
    task.add_done_callback(followers.discard)
    body = await queued
    metrics.BACKGROUND.labels(plan.job.model, "created").inc()
    return web.Response(body=body, content_type="application/json")


async def _follow(request: web.Request, plan: Plan, deadline: float, record: tuple[str, bytes, int], lease: str,
                  queued: asyncio.Future[bytes]) -> None:
    """Follows the job to its end; `queued` gets the response as it was queued (or the refusal)."""
    gateway, admitter, app = request.app[GATEWAY], request.app[ADMITTER], request.app
    key_id, tenant = caller_of(request).key_id, caller_of(request).tenant
    try:
        async with gateway.submit(plan.job, deadline, record, on_refused=admitter.refund) as events:
            queued.set_result(framing.body(plan.renderer.body()))  # before any event of it is rendered
            renderer = plan.renderer
            assert isinstance(renderer, ResponsesRenderer)  # nosec B101: an invariant (tokenbus never runs with -O)
            await pump.collect(events, renderer, plan.job.model,
                               lambda _turn: keep_first(app, tenant, renderer, plan.job.model))
    except Exception as exc:
        if not queued.done():
            queued.set_exception(exc)
        else:
            log.warning("following background response %s failed: %s", plan.job.id, type(exc).__name__)
    finally:
        if not queued.done():
            queued.cancel()
        with contextlib.suppress(Exception):
            await admitter.release(key_id, lease)


def adopt(request: web.Request, plan: Plan, body: bytes, deadline: float, lease: str) -> None:
    """A streamed background response whose client left before its end: a task of this edge follows it from
    then on (its log from sequence 0), stores its answer, and holds its concurrency lease until its end, as a
    background response that was never streamed is held."""
    task = asyncio.create_task(_adopted(request, plan, body, deadline, lease))
    followers = request.app[TASKS]
    followers.add(task)
    task.add_done_callback(followers.discard)


async def _adopted(request: web.Request, plan: Plan, body: bytes, deadline: float, lease: str) -> None:
    app, caller = request.app, caller_of(request)
    try:
        fresh = await PLANNERS[plan.name](app, caller, body, plan.arrival)  # renders the log from its start
        renderer = fresh.renderer
        assert isinstance(renderer, ResponsesRenderer)  # nosec B101: an invariant (tokenbus never runs with -O)
        async with app[GATEWAY].follow(plan.job, caller.key_id, deadline) as events:
            await pump.collect(events, renderer, plan.job.model,
                               lambda _turn: keep_first(app, caller.tenant, renderer, plan.job.model))
    except Exception as exc:
        log.warning("following background response %s failed: %s", plan.job.id, type(exc).__name__)
    finally:
        with contextlib.suppress(Exception):
            await app[ADMITTER].release(caller.key_id, lease)


async def _record(request: web.Request, response_id: str) -> tuple[StreamRecord, bool] | None:
    """The caller's background response's record (None: no such background response), and whether it was
    cancelled."""
    pipe = request.app[REDIS].pipeline(transaction=False)
    pipe.get(keys.job_record(response_id))
    pipe.exists(keys.cancelled(response_id))
    with redis_boundary():
        raw, cancelled = await pipe.execute()
    if raw is None:
        return None
    found = decode_record(raw)
    if not caller_of(request).owns(found.tenant) or not found.plan.startswith("responses"):
        return None
    return found, bool(cancelled)


async def _replan(request: web.Request, response_id: str, found: StreamRecord) -> Plan:
    arrival = Arrival(job_id=response_id, started=time.monotonic(), deadline_ms=found.deadline_ms,
                      reply_to=request.app[GATEWAY].relay.channel, created=found.created, seed=found.seed)
    return await PLANNERS[found.plan](request.app, caller_of(request), found.body, arrival)


async def snapshot(request: web.Request, response_id: str, cancel: bool = False) -> bytes | None:
    """The background response as its job's log has it now (None: the caller has no such response); an ended
    one is stored on the way. `cancel`: cancels it first, and an unended one answers cancelled."""
    if (found := await _record(request, response_id)) is None:
        return None
    record, cancelled = found
    snapshots = request.app[SNAPSHOTS]
    if cancel or cancelled:
        snapshots.forget(response_id)
    elif (body := snapshots.fresh(response_id)) is not None:
        return body
    plan = await _replan(request, response_id, record)
    renderer = plan.renderer
    if not plan.job.background or not isinstance(renderer, ResponsesRenderer):
        return None
    await _replay(request, renderer, response_id)
    if cancel and not cancelled:
        if renderer.ended:  # as OpenAI: what ended stays as it ended (cancelling a cancelled one is no error)
            raise InvalidRequest(f"Cannot cancel {_article(renderer.status)} {renderer.status} response.")
        await request.app[GATEWAY].cancel(response_id, time.monotonic() + request.app[SETTINGS].request_timeout_s)
        cancelled = True
    if not renderer.ended and cancelled:
        renderer.error(StreamAbandoned("The response was cancelled."))
    if renderer.ended:
        await keep_first(request.app, caller_of(request).tenant, renderer, plan.job.model)
        return framing.body(renderer.body())
    body = framing.body(renderer.body())
    snapshots.keep(response_id, body)
    return body


async def forget(request: web.Request, response_id: str, ended: bool) -> bool:
    """DELETE of a response: the caller's response's record goes (nothing can read, resume or store it again from
    its log) and, if it had not `ended`, its job is cancelled; an ended one's log goes too (a running job's expires
    after it: its worker may write to it until the cancel reaches it). False: the caller has no such record."""
    found = await _record(request, response_id)
    if found is None:
        return False
    if not ended:  # its answer, when it comes, is not to be stored: the id stays free of one while the job may run
        await request.app[STORE].bar(caller_of(request).tenant, response_id, found[0].deadline_ms + BAR_GRACE_MS)
    pipe = request.app[REDIS].pipeline(transaction=False)
    pipe.delete(keys.job_record(response_id))
    if ended:
        pipe.delete(keys.job_log(response_id))
    with redis_boundary():
        await pipe.execute()
    if not ended:
        await request.app[GATEWAY].cancel(response_id, time.monotonic() + request.app[SETTINGS].request_timeout_s)
    return True


async def input_items(request: web.Request, response_id: str) -> list[bytes] | None:
    """The input items of the caller's background response still running (planned again from its record: their
    ids are those it will be stored with), or None: no such response."""
    found = await _record(request, response_id)
    if found is None:
        return None
    plan = await _replan(request, response_id, found[0])
    assert isinstance(plan.renderer, ResponsesRenderer)  # nosec B101: an invariant (tokenbus never runs with -O)
    return plan.renderer.new_items


async def retrieve(request: web.Request, response_id: str) -> web.Response:
    body = await snapshot(request, response_id)
    if body is None:
        raise NotFound(f"No response with id '{response_id}' is stored.", param="response_id")
    return web.Response(body=body, content_type="application/json")


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel: only a background response can be cancelled, and only before it ends (a
    400 after, as OpenAI's; again once cancelled, the cancelled response)."""
    response_id = request.match_info["response_id"]
    stored = await request.app[STORE].head(caller_of(request).tenant, response_id)
    if stored is not None and caller_of(request).owns(stored.tenant):
        return _cancel_ended(bytes(stored.response))
    body = await snapshot(request, response_id, cancel=True)
    if body is None:
        raise NotFound(f"No response with id '{response_id}' is stored.", param="response_id")
    return web.Response(body=body, content_type="application/json")


def _cancel_ended(stored: bytes) -> web.Response:
    """The cancel of a stored response, which has ended: answered from what was stored, not from its job's log (a
    cancel spends no rpm, and a log's replay costs the edge as much as its length)."""
    found = msgspec.json.decode(stored, type=_Ended)
    if not found.background:
        raise InvalidRequest("Only a background response can be cancelled.", param="response_id")
    if found.status != "cancelled":
        raise InvalidRequest(f"Cannot cancel {_article(found.status)} {found.status} response.")
    return web.Response(body=stored, content_type="application/json")


class _Ended(msgspec.Struct):
    """What a cancel reads of a stored response."""

    status: str = ""
    background: bool | None = False


def _article(word: str) -> str:
    return "an" if word[:1] in ("a", "e", "i", "o", "u") else "a"


async def _replay(request: web.Request, renderer: ResponsesRenderer, response_id: str) -> None:
    """Brings the renderer to where the job's log leaves it, a page of the log at a time: a log of
    --replay-max-events read and rendered whole held the edge's loop for a quarter of a second, for a retrieve of
    a long running response (one a second) or a cancel (which spends no rpm)."""
    read_page, after, more = request.app[GATEWAY].relay.read_log, "", True
    ordered = sequence.InOrder(hold=joblog.PAGE_ENTRIES)
    while more and not renderer.ended and not ordered.stopped:
        page, after, more = await read_page(response_id, after)
        _render(renderer, ordered.take(page))


def _render(renderer: ResponsesRenderer, events: list[bus.Event]) -> None:
    """Brings the renderer on by the job's next events (in order)."""
    for event in events:
        if renderer.ended:
            return
        if isinstance(event, bus.Started) and renderer.status == "queued":
            renderer.status = "in_progress"
        elif isinstance(event, bus.Error):
            renderer.error(from_kind(event.kind, event.message, event.param, event.code))
        elif isinstance(event, bus.Output):
            renderer.render(event)


def starting_after(request: web.Request) -> int:
    """GET /v1/responses/{id}?stream=true&starting_after=N: the sequence number the client has (-1: none)."""
    given = request.query.get("starting_after", "")
    if not given:
        return -1
    if not (given.isascii() and given.isdigit() and len(given) <= 18):
        raise InvalidRequest("`starting_after` must be a sequence number.", param="starting_after")
    return int(given)


def add_to(app: web.Application) -> None:
    app[TASKS] = set()
    app[SNAPSHOTS] = Snapshots()
    app.on_shutdown.append(_stop_following)


async def _stop_following(app: web.Application) -> None:
    """An edge going away stops following its background responses (they run on; the first edge asked for one
    stores it): their leases are given back now, not when their TTL runs out."""
    running: set[asyncio.Task[None]] = app[TASKS]
    await cancel_and_wait(list(running))
