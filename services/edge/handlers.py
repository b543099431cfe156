"""The generation routes: each decodes its format, builds a job and lets the pump answer."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import orjson
from aiohttp import web

from services.edge import pump
from services.edge.formats import chat, completions, embeddings, responses, tgi
from services.edge.formats.base import Renderer, decode, encode, unknown_fields
from services.edge.state import GATEWAY, SETTINGS, STORE
from shared import bus, metrics
from shared.errors import InvalidRequest, NotFound

T = TypeVar("T", bound=msgspec.Struct)


@dataclass(frozen=True)
class Arrival:
    """What every generation request gets on arrival: its id, its deadline, where its events go."""

    job_id: str
    started: float
    deadline_ms: int
    reply_to: str


def _decode(body: bytes, kind: type[T], route: str) -> T:
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
    deadline = arrival.started + settings.request_timeout_s
    metrics.IN_FLIGHT.inc()
    try:
        async with gateway.submit(job, deadline) as events:
            return await pump.respond(request, events, renderer, stream=stream, route=route,
                                      keepalive_s=settings.keepalive_interval_s, started=arrival.started)
    finally:
        metrics.IN_FLIGHT.dec()
        metrics.REQUEST_DURATION.labels(route).observe(time.monotonic() - arrival.started)


# OpenAI


async def _chat(request: web.Request, body: bytes) -> web.StreamResponse:
    req = _decode(body, chat.ChatCompletionRequest, "chat")
    await request.app[GATEWAY].require_model(req.model)
    arrival = _arrive(request, "chatcmpl-")
    job = chat.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = chat.ChatRenderer(req, response_id=arrival.job_id, created=int(time.time()))
    return await _generate(request, arrival, job, renderer, stream=req.stream, route="chat")


async def _completions(request: web.Request, body: bytes, raw_prompt_default: bool = True) -> web.StreamResponse:
    req = _decode(body, completions.CompletionRequest, "completions")
    if req.use_raw_prompt is None and not raw_prompt_default:
        req.use_raw_prompt = False
    await request.app[GATEWAY].require_model(req.model)
    arrival = _arrive(request, "cmpl-")
    job = completions.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to,
                             deadline_ms=arrival.deadline_ms)
    renderer = completions.CompletionRenderer(req, response_id=arrival.job_id, created=int(time.time()))
    return await _generate(request, arrival, job, renderer, stream=req.stream, route="completions")


async def _responses(request: web.Request, body: bytes) -> web.StreamResponse:
    req = _decode(body, responses.ResponsesRequest, "responses")
    responses.refuse_unsupported(req)
    await request.app[GATEWAY].require_model(req.model)
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


async def _embeddings(request: web.Request, body: bytes) -> web.StreamResponse:
    req = _decode(body, embeddings.EmbeddingRequest, "embeddings")
    info = await request.app[GATEWAY].require_model(req.model, task="embed")
    embeddings.check_dimensions(req, info.dimensions)
    arrival = _arrive(request, "embd-")
    job = embeddings.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    return await _generate(request, arrival, job, embeddings.EmbeddingRenderer(req), stream=False,
                           route="embeddings")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _chat(request, await request.read())


async def text_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, await request.read())


async def create_response(request: web.Request) -> web.StreamResponse:
    return await _responses(request, await request.read())


async def create_embeddings(request: web.Request) -> web.StreamResponse:
    return await _embeddings(request, await request.read())


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
    models = request.app[GATEWAY].directory.models
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "tokenbus", "task": info.task,
             "max_model_len": info.max_model_len} for name, info in sorted(models.items())]
    return web.Response(body=encode({"object": "list", "data": data}), content_type="application/json")


# Databricks


async def invocations(request: web.Request) -> web.StreamResponse:
    """Databricks' serving endpoint: the path names the model, the body's fields decide the task."""
    name = request.match_info["name"]
    body = await request.read()
    fields = decode(body, dict[str, msgspec.Raw])
    info = await request.app[GATEWAY].find_model(name)
    body = orjson.dumps({**{k: orjson.Fragment(bytes(v)) for k, v in fields.items()}, "model": name})
    if "messages" in fields:
        return await _chat(request, body)
    if "prompt" in fields:
        return await _completions(request, body, raw_prompt_default=False)
    if "input" in fields:
        return await (_embeddings if info.task == "embed" else _responses)(request, body)
    raise InvalidRequest("The body needs `messages` (chat), `prompt` (completions) or `input` "
                         "(embeddings, or responses for a generation model).", param="messages")


# TGI / MindIE


async def _tgi(request: web.Request, stream: bool | None, array_body: bool = False) -> web.StreamResponse:
    settings, gateway = request.app[SETTINGS], request.app[GATEWAY]
    req = _decode(await request.read(), tgi.GenerateRequest, "tgi")
    streaming = req.stream if stream is None else stream
    model = req.model or settings.model
    info = await gateway.require_model(model)
    seed = tgi.draw_seed(req)
    arrival = _arrive(request, "gen-")
    job = tgi.to_job(req, model=model, seed=seed, stream=streaming, adapters=info.adapters,
                     job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = tgi.TgiRenderer(req, seed=seed, array_body=array_body)
    return await _generate(request, arrival, job, renderer, stream=streaming, route="tgi")


async def generate(request: web.Request) -> web.StreamResponse:
    return await _tgi(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _tgi(request, stream=True)


async def compat_generate(request: web.Request) -> web.StreamResponse:
    """TGI's and MindIE's `/`: the body's `stream` decides; the JSON answer is a one-item array."""
    return await _tgi(request, stream=None, array_body=True)


async def tgi_info(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    info = await request.app[GATEWAY].require_model(settings.model)
    body = tgi.Info(model_id=settings.model, max_concurrent_requests=info.slots,
                    max_input_tokens=info.max_model_len - 1, max_total_tokens=info.max_model_len, version=_version())
    return web.Response(body=encode(body), content_type="application/json")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokenbus")
    except PackageNotFoundError:
        return "0+unknown"
