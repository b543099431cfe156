"""The generation routes: each decodes its format, builds a job and lets the pump answer."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from aiohttp import web

from services.edge import pump
from services.edge.formats import chat, completions, responses
from services.edge.formats.base import Renderer, decode, encode, unknown_fields
from services.edge.state import GATEWAY, SETTINGS, STORE
from shared import bus, metrics
from shared.errors import NotFound

T = TypeVar("T", bound=msgspec.Struct)


@dataclass(frozen=True)
class Arrival:
    """What every generation request gets on arrival: its id, its deadline, where its events go."""

    job_id: str
    started: float
    deadline_ms: int
    reply_to: str


async def _read(request: web.Request, kind: type[T], route: str) -> T:
    body = await request.read()
    parsed = decode(body, kind)
    if ignored := unknown_fields(body, kind):
        metrics.UNKNOWN_FIELDS.labels(route).inc(len(ignored))
    return parsed


def _arrive(request: web.Request, prefix: str) -> Arrival:
    timeout_s = request.app[SETTINGS].request_timeout_s
    return Arrival(job_id=f"{prefix}{uuid.uuid4().hex}", started=time.monotonic(),
                   deadline_ms=bus.now_ms() + int(timeout_s * 1000),
                   reply_to=request.app[GATEWAY].relay.stream)


async def _generate(
    request: web.Request, arrival: Arrival, job: bus.Job, renderer: Renderer, *, stream: bool, route: str
) -> web.StreamResponse:
    settings, gateway = request.app[SETTINGS], request.app[GATEWAY]
    await gateway.require_model(job.model)
    deadline = arrival.started + settings.request_timeout_s
    metrics.IN_FLIGHT.inc()
    try:
        async with gateway.submit(job, deadline) as events:
            return await pump.respond(request, events, renderer, stream=stream, route=route,
                                      keepalive_s=settings.keepalive_interval_s, started=arrival.started)
    finally:
        metrics.IN_FLIGHT.dec()
        metrics.REQUEST_DURATION.labels(route).observe(time.monotonic() - arrival.started)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await _read(request, chat.ChatCompletionRequest, "chat")
    arrival = _arrive(request, "chatcmpl-")
    job = chat.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = chat.ChatRenderer(req, response_id=arrival.job_id, created=int(time.time()))
    return await _generate(request, arrival, job, renderer, stream=req.stream, route="chat")


async def text_completions(request: web.Request) -> web.StreamResponse:
    req = await _read(request, completions.CompletionRequest, "completions")
    arrival = _arrive(request, "cmpl-")
    job = completions.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to,
                             deadline_ms=arrival.deadline_ms)
    renderer = completions.CompletionRenderer(req, response_id=arrival.job_id, created=int(time.time()))
    return await _generate(request, arrival, job, renderer, stream=req.stream, route="completions")


async def create_response(request: web.Request) -> web.StreamResponse:
    req = await _read(request, responses.ResponsesRequest, "responses")
    responses.refuse_unsupported(req)
    store = request.app[STORE]
    history: list[bus.Message] = []
    if req.previous_response_id:
        previous = await store.load(req.previous_response_id)
        if previous is None:
            raise NotFound(f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id")
        history = previous.history
    history = history + responses.input_messages(req)
    arrival = _arrive(request, "resp_")
    job = responses.to_job(req, history, job_id=arrival.job_id, reply_to=arrival.reply_to,
                           deadline_ms=arrival.deadline_ms)
    renderer = responses.ResponsesRenderer(req, response_id=arrival.job_id, created_at=int(time.time()),
                                           history=history, store=store)
    return await _generate(request, arrival, job, renderer, stream=req.stream, route="responses")


def _not_found(response_id: str) -> NotFound:
    return NotFound(f"No response with id '{response_id}' is stored.", param="response_id")


async def get_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = await request.app[STORE].load(response_id)
    if stored is None:
        raise _not_found(response_id)
    return web.Response(body=bytes(stored.response), content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not await request.app[STORE].delete(response_id):
        raise _not_found(response_id)
    return web.Response(body=encode(responses.Deleted(id=response_id)), content_type="application/json")


async def list_models(request: web.Request) -> web.Response:
    models = await request.app[GATEWAY].live_models()
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "tokenbus",
             "max_model_len": info.get("max_model_len")} for name, info in sorted(models.items())]
    return web.Response(body=encode({"object": "list", "data": data}), content_type="application/json")
