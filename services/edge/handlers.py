"""The routes: generation (a plan from services.edge.plans, answered by the pump), resumed streams, stored
responses, models and TGI's info."""

from __future__ import annotations

import functools
import time

import msgspec
import orjson
from aiohttp import web

from services.edge import background, conversations, pump, sse
from services.edge.auth import caller_of
from services.edge.conversation_store import keep_turn
from services.edge.estimate import check_prompt_fits, check_stops
from services.edge.formats import conversation_items, response_render, tgi
from services.edge.formats.base import decode, encode
from services.edge.formats.models import ModelCard, ModelList
from services.edge.formats.planners import Arrival
from services.edge.jobevents import JobEvents
from services.edge.plans import PLANNERS, Plan, decode_record
from services.edge.server import read_body
from services.edge.state import (
    ADMITTER,
    CALL_GATE,
    CONVERSATIONS,
    GATEWAY,
    RATE_HEADERS,
    REDIS,
    REQUEST_ID,
    SETTINGS,
    STORE,
)
from services.edge.store import StoredHead
from shared.protocol import bus, keys
from shared.protocol.errors import InvalidRequest, ModelNotFound, NotFound, RateLimited
from shared.runtime import metrics
from shared.runtime.settings import Settings
from shared.tenancy import fairshare

MAX_READERS = 4
"""Requests of one edge that may read one stream at once (its client's, a resume after it reconnected, a background
response's follower): each holds a connection and the events since it began, and takes no concurrency lease of its
own (a resume continues its stream's)."""

OVMS_PREFIX = "/v3"
"""OpenVINO Model Server's paths for the OpenAI API: every /v1 route is served under /v3 too, and its
Responses stream differs from OpenAI's in the small ways its page documents."""


async def _generate(request: web.Request, plan: Plan, body: bytes) -> web.StreamResponse:
    if not plan.job.background and sse.SSEWriter.client_gone(request):
        raise sse.ClientGone  # it left while its request was read, planned and checked: nothing is charged or queued
    settings, gateway, admitter = request.app[SETTINGS], request.app[GATEWAY], request.app[ADMITTER]
    arrival, caller = plan.arrival, caller_of(request)
    deadline = arrival.started + settings.request_timeout_s
    info = gateway.directory.models.get(plan.job.model)
    fairshare.check_fits(plan.job, info)
    check_prompt_fits(plan.job, info.max_model_len if info else 0, plan.route)
    check_stops(plan.job, settings.max_stop_sequences, plan.route)
    plan.job.request_id = request.get(REQUEST_ID, "")
    tenant = (admitter.tenants.label(caller.tenant), plan.job.model)
    resumable = plan.job.background or (plan.stream and sse.wants_ids(request))
    if plan.job.background:  # its log is its record, from sequence 0, for the retention window after it ends
        plan.job.log_ttl_ms = int(settings.background_ttl_s * 1000)
    if resumable:  # kept to be resumed: its request and event log count against its tenant's storage
        plan.job.replayable = True
        await request.app[STORE].charge_stream(caller.tenant, caller.key, plan.job, len(body))
    try:
        admission = await admitter.admit(caller, plan.job, info.max_model_len if info else 0)
    except RateLimited as exc:
        metrics.TENANT_REQUESTS.labels(*tenant, exc.type).inc()
        raise
    metrics.TENANT_REQUESTS.labels(*tenant, "admitted").inc()
    request[RATE_HEADERS] = admission.headers
    record = None
    if resumable:  # kept so that any edge can resume the stream
        ttl_ms = int(settings.request_timeout_s * 1000) + plan.job.log_kept_ms(int(settings.replay_ttl_s * 1000))
        stream = plan.record(body, caller.tenant, caller.key_id, admission.lease)
        record = (keys.job_record(arrival.job_id), _records.encode(stream), ttl_ms)
    if plan.job.background and not plan.stream and record is not None:
        return await background.start(request, plan, deadline, record, admission.lease)
    in_flight = metrics.IN_FLIGHT.labels(plan.job.model)
    in_flight.inc()
    events: JobEvents | None = None
    adopted = False
    try:
        async with gateway.submit(plan.job, deadline, record, on_refused=admitter.refund) as events:
            return await pump.respond(request, events, plan.renderer, stream=plan.stream, model=plan.job.model,
                                      keepalive_s=settings.keepalive_interval_s, started=arrival.started,
                                      tenant=tenant, ids=sse.wants_ids(request), keep=_keeper(request),
                                      write_stall_s=settings.write_stall_s)
    except sse.ClientGone:
        if plan.job.background and events is not None and not events.finished:
            background.adopt(request, plan, body, deadline, admission.lease)  # it holds the lease from now on
            adopted = True
        raise
    finally:
        in_flight.dec()
        metrics.REQUEST_DURATION.labels(plan.job.model).observe(time.monotonic() - arrival.started)
        if not adopted:
            await admitter.release(caller.key_id, admission.lease, keep_for_s=_kept_for(settings, events))


def _keeper(request: web.Request) -> pump.Keep:
    """Stores a finished turn as the caller's tenant's (its response, and its conversation's items), once."""
    args = (request.app[STORE], request.app[CONVERSATIONS], caller_of(request).tenant)
    return functools.partial(keep_turn, *args)


def _kept_for(settings: Settings, events: JobEvents | None) -> float:
    """How long a job's lease stays held after its request ended: its resume window (and a renewal round) when
    the job runs on for a resume, else not at all."""
    return settings.resume_window_s + settings.lease_ttl_s / 3 if events is not None and events.kept else 0.0


async def _planned(request: web.Request, planner: str, body: bytes | None = None) -> web.StreamResponse:
    """Serves a generation request, or resumes its stream when it carries a Last-Event-ID. Either way its
    request unit is spent first (see Admitter.take_request)."""
    if body is None:  # a body given was read by a route that spent the request already
        request[RATE_HEADERS] = await request.app[ADMITTER].take_request(caller_of(request))
    if (last := request.headers.get("Last-Event-ID")) is not None:
        job_id, after = parse_event_id(last)
        return await resume(request, job_id, after)
    body = await read_body(request) if body is None else body
    return await _generate(request, await PLANNERS[planner](request.app, caller_of(request), body, None), body)



# Resumed streams


_records = msgspec.msgpack.Encoder()


def parse_event_id(value: str) -> tuple[str, int]:
    """A Last-Event-ID as tokenbus writes them: `{stream id}:{frame number}`."""
    job_id, _, number = value.strip().rpartition(":")
    # isascii: str.isdigit() also takes digits such as '²' that int() refuses; the length keeps int() cheap
    if not job_id or not (number.isascii() and number.isdigit() and len(number) <= 18):
        raise InvalidRequest("Last-Event-ID must be an id this service sent: `{stream id}:{number}`.",
                             param="Last-Event-ID", code="invalid_event_id")
    return job_id, int(number)


async def resume_stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/streams/{id}: the stream from the frame after Last-Event-ID (all of it without one)."""
    request[RATE_HEADERS] = await request.app[ADMITTER].take_request(caller_of(request))
    job_id = request.match_info["stream_id"]
    last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    after = -1
    if last:
        named, after = parse_event_id(last)
        if named != job_id:
            raise InvalidRequest("Last-Event-ID belongs to another stream.", param="Last-Event-ID",
                                 code="invalid_event_id")
    return await resume(request, job_id, after)


async def resume(request: web.Request, job_id: str, after: int, background_only: bool = False) -> web.StreamResponse:
    """Renders a stream again from its job's log on this edge, sends what follows frame `after`, then the
    rest live: the job's owner sends its events here from now on. The job's concurrency lease is this edge's to
    renew while it serves the stream."""
    settings, gateway, admitter = request.app[SETTINGS], request.app[GATEWAY], request.app[ADMITTER]
    request.app[CALL_GATE].leave(request)  # a stream for as long as it runs: its rpm and readers' cap meter it
    gateway.check_redis()
    pipe = request.app[REDIS].pipeline(transaction=False)
    pipe.get(keys.job_record(job_id))
    pipe.exists(keys.cancelled(job_id))
    raw, cancelled = await pipe.execute()
    if raw is None:
        raise NotFound(f"No stream with id '{job_id}' can be resumed (unknown, or it ended too long ago).",
                       param="stream_id", code="stream_not_found")
    record = decode_record(raw)
    if not caller_of(request).owns(record.tenant):  # another tenant's stream does not exist for this caller
        raise NotFound(f"No stream with id '{job_id}' can be resumed (unknown, or it ended too long ago).",
                       param="stream_id", code="stream_not_found")
    arrival = Arrival(job_id=job_id, started=time.monotonic(), deadline_ms=record.deadline_ms,
                      reply_to=gateway.relay.channel, created=record.created, seed=record.seed)
    plan = await PLANNERS[record.plan](request.app, caller_of(request), record.body, arrival)
    if background_only and not plan.job.background:
        raise NotFound(f"No background response with id '{job_id}' can be streamed.", param="response_id")
    if gateway.relay.readers(job_id) >= MAX_READERS:
        raise RateLimited(f"The stream has {MAX_READERS} readers on this server already; close one to read it "
                          "again.", limit="concurrency", retry_after_s=1.0)
    deadline = arrival.started + (record.deadline_ms - bus.now_ms()) / 1000
    metrics.RESUMES.labels(plan.route).inc()
    in_flight = metrics.IN_FLIGHT.labels(plan.job.model)
    in_flight.inc()
    lease = "" if plan.job.background else record.lease  # a background job's lease is its follower's
    admitter.hold(record.key, lease)
    events: JobEvents | None = None
    try:
        async with gateway.follow(plan.job, record.key, deadline, caller_of(request).key_id) as events:
            events.abandoned = bool(cancelled)  # a job cancelled before it ended never ends by itself
            return await pump.respond(request, events, plan.renderer, stream=True, model=plan.job.model,
                                      keepalive_s=settings.keepalive_interval_s, started=arrival.started,
                                      after=after, keep=_keeper(request),
                                      write_stall_s=settings.write_stall_s)
    except sse.ClientGone:
        if plan.job.background and events is not None and not events.finished and not cancelled:
            # its events come here now, and nowhere else: a task of this edge follows it and stores its answer
            background.adopt(request, plan, record.body, deadline, lease)
        raise
    finally:
        in_flight.dec()
        await admitter.release(record.key, lease, keep_for_s=_kept_for(settings, events))


# OpenAI


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "chat")


async def text_completions(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "completions")


async def create_response(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "responses_ovms" if request.path.startswith(OVMS_PREFIX + "/") else "responses")


async def count_input_tokens(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "responses_input_tokens")


async def tokenize(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "tokenize")


async def detokenize(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "detokenize")


async def create_embeddings(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "embeddings")


async def rerank(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "rerank")


async def score(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "score")


# Anthropic


async def create_message(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "messages")


async def count_message_tokens(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "messages_count")


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"No response with id '{response_id}' is stored.", param="response_id")


async def _stored(request: web.Request, response_id: str) -> StoredHead | None:
    """A stored response of the caller's tenant; another tenant's is as absent as a missing one."""
    stored = await request.app[STORE].head(caller_of(request).tenant, response_id)
    return stored if stored is not None and caller_of(request).owns(stored.tenant) else None


async def get_response(request: web.Request) -> web.StreamResponse:
    """A stored response; a background one as it stands (or streamed from a sequence number, `stream=true`)."""
    response_id = request.match_info["response_id"]
    if request.query.get("stream", "").lower() == "true":
        request[RATE_HEADERS] = await request.app[ADMITTER].take_request(caller_of(request))
        return await resume(request, response_id, background.starting_after(request), background_only=True)
    if (stored := await _stored(request, response_id)) is not None:
        return web.Response(body=bytes(stored.response), content_type="application/json")
    return await background.retrieve(request, response_id)


async def list_input_items(request: web.Request) -> web.Response:
    """The input items of a stored response (`limit`, `order`, `after`, as a conversation's items)."""
    response_id = request.match_info["response_id"]
    if (stored := await _stored(request, response_id)) is not None:
        inputs: list[bytes] | None = [bytes(item) for item in stored.inputs]
    else:  # a background response still running
        inputs = await background.input_items(request, response_id)
    if inputs is None:
        raise _not_found(response_id)
    items = [conversation_items.decode_item(item) for item in inputs]
    page = conversations.item_page(request, items, "the response's input")
    return web.Response(body=encode(page), content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    """Deletes a stored response, and the record a background or resumable one ran from (a background response
    still running is cancelled): from then on it is gone from every route, as OpenAI's is."""
    response_id = request.match_info["response_id"]
    owned = await _stored(request, response_id) is not None
    recorded = await background.forget(request, response_id, ended=owned)
    if owned:
        owned = await request.app[STORE].delete(caller_of(request).tenant, response_id)
    if not owned and not recorded:
        raise _not_found(response_id)
    return web.Response(body=encode(response_render.Deleted(id=response_id)), content_type="application/json")


async def list_models(request: web.Request) -> web.Response:
    """The models with a live worker and their adapters the caller may use (an adapter names its `parent`)."""
    return web.Response(body=encode(ModelList(data=_model_cards(request))), content_type="application/json")


async def retrieve_model(request: web.Request) -> web.Response:
    """One of the models `list_models` shows the caller; any other does not exist for it."""
    name = request.match_info["model"]
    card = next((card for card in _model_cards(request) if card.id == name), None)
    if card is None:
        raise ModelNotFound(f"The model `{name}` does not exist or has no live worker.", param="model")
    return web.Response(body=encode(card), content_type="application/json")


def _model_cards(request: web.Request) -> list[ModelCard]:
    directory, caller = request.app[GATEWAY].directory, caller_of(request)
    cards = [ModelCard(id=name, root=name, task=info.task, max_model_len=info.max_model_len)
             for name, info in sorted(directory.models.items()) if caller.key is None or caller.key.may_use(name)]
    cards += [ModelCard(id=adapter.name, created=adapter.created_at, owned_by=adapter.tenant or "tokenbus",
                        root=adapter.name, parent=adapter.base,
                        max_model_len=directory.models[adapter.base].max_model_len)
              for adapter in directory.visible_adapters(caller.sees)
              if adapter.name not in directory.models and (caller.key is None or caller.key.may_use(adapter.name))]
    return cards


# Databricks


async def invocations(request: web.Request) -> web.StreamResponse:
    """Databricks' serving endpoint: the path names the model, the body's fields decide the task."""
    name = request.match_info["name"]
    request[RATE_HEADERS] = await request.app[ADMITTER].take_request(caller_of(request))
    body = await read_body(request)
    fields = decode(body, dict[str, msgspec.Raw])
    caller_of(request).check_model(name)
    info, _ = await request.app[GATEWAY].find_model(name, caller_of(request).sees)
    body = orjson.dumps({**{k: orjson.Fragment(bytes(v)) for k, v in fields.items()}, "model": name})
    if "messages" in fields:
        return await _planned(request, "chat", body)
    if "prompt" in fields:
        return await _planned(request, "completions_templated", body)
    if "input" in fields:
        return await _planned(request, "embeddings" if info.task == "embed" else "responses", body)
    raise InvalidRequest("The body needs `messages` (chat), `prompt` (completions) or `input` "
                         "(embeddings, or responses for a generation model).", param="messages")


# TGI / MindIE


async def generate(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "tgi")


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _planned(request, "tgi_stream")


async def compat_generate(request: web.Request) -> web.StreamResponse:
    """TGI's and MindIE's `/`: the body's `stream` decides; the JSON answer is a one-item array."""
    return await _planned(request, "tgi_compat")


async def tgi_info(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    caller_of(request).check_model(settings.model)
    info, _ = await request.app[GATEWAY].require_model(settings.model)
    body = tgi.Info(model_id=settings.model, max_concurrent_requests=info.slots,
                    max_input_tokens=info.max_model_len - 1, max_total_tokens=info.max_model_len, version=_version(),
                    max_stop_sequences=settings.max_stop_sequences)
    return web.Response(body=encode(body), content_type="application/json")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenbus")
    except PackageNotFoundError:
        return "0+unknown"
