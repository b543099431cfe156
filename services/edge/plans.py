"""How each generation route turns a request body into a job and the renderer of its answer: a plan.

A plan depends only on the body and the request's arrival (id, creation time, seed), so any edge can make
the same plan again from a stored `StreamRecord` and render a resumed stream exactly as it began.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from aiohttp import web

from services.edge import schema_checks
from services.edge.auth import caller_of
from services.edge.formats import chat, completions, embeddings, responses, tgi
from services.edge.formats.base import Renderer, decode, unknown_fields
from services.edge.state import CHECKER, GATEWAY, SETTINGS, STORE
from services.edge.store import Conversation
from shared.protocol import bus
from shared.protocol.errors import NotFound
from shared.runtime import metrics

T = TypeVar("T", bound=msgspec.Struct)


@dataclass(frozen=True)
class Arrival:
    """What every generation request gets on arrival: its id, its deadline, where its events go."""

    job_id: str
    started: float
    deadline_ms: int
    reply_to: str
    created: int
    """Unix seconds, as the answer reports them."""
    seed: int | None = None
    """TGI's drawn seed, kept so that a resumed stream reports the same one."""


class StreamRecord(msgspec.Struct, omit_defaults=True):
    """How a streamed job was asked for: the plan's name, the body, the arrival's fixed parts."""

    plan: str
    body: bytes
    created: int
    deadline_ms: int
    seed: int | None = None
    tenant: str = ""
    """Whose stream it is: only that tenant may resume it."""
    key: str = ""
    """The id of the API key it was admitted for ("" without keys): whose concurrency lease the job holds."""
    lease: str = ""
    """That lease ("" for none): an edge that resumes the stream renews it while it serves the stream."""


@dataclass(frozen=True)
class Plan:
    """A job and the renderer of its answer."""

    name: str
    """Which planner made it (the key of PLANNERS)."""
    arrival: Arrival
    job: bus.Job
    renderer: Renderer
    stream: bool
    route: str
    """The metrics label of the route."""

    def record(self, body: bytes, tenant: str, key: str = "", lease: str = "") -> StreamRecord:
        return StreamRecord(plan=self.name, body=body, created=self.arrival.created,
                            deadline_ms=self.arrival.deadline_ms, seed=self.arrival.seed, tenant=tenant, key=key,
                            lease=lease)


Planner = Callable[[web.Request, bytes, Arrival | None], Awaitable[Plan]]


def _decode(body: bytes, kind: type[T], route: str) -> T:
    parsed = decode(body, kind)
    if ignored := unknown_fields(body, kind):
        metrics.UNKNOWN_FIELDS.labels(route).inc(len(ignored))
    return parsed


async def _model(request: web.Request, model: str, task: str = "generate") -> bus.WorkerInfo:
    """A model the caller's key may use, with a live worker for the task; else a 404 (or 400 for a task)."""
    caller_of(request).check_model(model)
    return await request.app[GATEWAY].require_model(model, task=task)


def arrive(request: web.Request, prefix: str, seed: int | None = None) -> Arrival:
    timeout_s = request.app[SETTINGS].request_timeout_s
    return Arrival(job_id=f"{prefix}{uuid.uuid4().hex}", started=time.monotonic(),
                   deadline_ms=bus.now_ms() + int(timeout_s * 1000),
                   reply_to=request.app[GATEWAY].relay.channel, created=int(time.time()), seed=seed)


async def plan_chat(request: web.Request, body: bytes, given: Arrival | None) -> Plan:
    req = _decode(body, chat.ChatCompletionRequest, "chat")
    info = await _model(request, req.model)
    chat.check_context(req, info.max_model_len)
    arrival = given or arrive(request, "chatcmpl-")
    job = chat.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = chat.ChatRenderer(req, response_id=arrival.job_id, created=arrival.created)
    return Plan("chat", arrival, job, renderer, req.stream, "chat")


async def plan_completions(request: web.Request, body: bytes, given: Arrival | None,
                           raw_prompt_default: bool = True) -> Plan:
    req = _decode(body, completions.CompletionRequest, "completions")
    if not raw_prompt_default:  # Databricks' completions: the chat template, and no token limit by default
        if req.use_raw_prompt is None:
            req.use_raw_prompt = False
        if "max_tokens" not in msgspec.json.decode(body, type=dict[str, msgspec.Raw]):
            req.max_tokens = None
    info = await _model(request, req.model)
    completions.check_context(req, info.max_model_len)
    arrival = given or arrive(request, "cmpl-")
    job = completions.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to,
                             deadline_ms=arrival.deadline_ms)
    renderer = completions.CompletionRenderer(req, response_id=arrival.job_id, created=arrival.created)
    name = "completions" if raw_prompt_default else "completions_templated"
    return Plan(name, arrival, job, renderer, req.stream, "completions")


async def plan_responses(request: web.Request, body: bytes, given: Arrival | None, ovms: bool = False) -> Plan:
    """OpenAI Responses; `ovms`: as OVMS serves it on /v3 (see ResponsesRenderer.ovms)."""
    req = _decode(body, responses.ResponsesRequest, "responses")
    responses.refuse_unsupported(req)
    info = await _model(request, req.model)
    responses.check_context(req, info.max_model_len)
    store, caller = request.app[STORE], caller_of(request)
    conversation = Conversation()
    if req.previous_response_id:
        found = await store.conversation(caller.tenant, req.previous_response_id)
        if found is None:
            raise NotFound(f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id")
        conversation = found
    added = responses.input_messages(req, conversation.history)
    responses.check_length(req, conversation, added)
    if req.store and given is None:  # a resumed stream was checked when it began
        await store.check_room(caller.tenant, caller.key, len(body))
    arrival = given or arrive(request, "resp_")
    job = responses.to_job(req, conversation.history + added, job_id=arrival.job_id, reply_to=arrival.reply_to,
                           deadline_ms=arrival.deadline_ms)
    renderer = responses.ResponsesRenderer(req, response_id=arrival.job_id, created_at=arrival.created,
                                           conversation=conversation, added=added, ovms=ovms)
    return Plan("responses_ovms" if ovms else "responses", arrival, job, renderer, req.stream, "responses")


async def plan_embeddings(request: web.Request, body: bytes, given: Arrival | None) -> Plan:
    req = _decode(body, embeddings.EmbeddingRequest, "embeddings")
    info = await _model(request, req.model, task="embed")
    embeddings.check_dimensions(req, info.dimensions)
    arrival = given or arrive(request, "embd-")
    job = embeddings.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    return Plan("embeddings", arrival, job, embeddings.EmbeddingRenderer(req, arrival.job_id), False, "embeddings")


async def plan_tgi(request: web.Request, body: bytes, given: Arrival | None, *, stream: bool | None,
                   array_body: bool = False, name: str = "tgi") -> Plan:
    """TGI / MindIE; `stream` None: the body's `stream` decides (the `/` route)."""
    settings = request.app[SETTINGS]
    req = _decode(body, tgi.GenerateRequest, "tgi")
    streaming = req.stream if stream is None else stream
    model = req.model or settings.model
    info = await _model(request, model)
    tgi.check_context(req, info.max_model_len)
    arrival = given or arrive(request, "gen-", seed=tgi.draw_seed(req))
    seed = arrival.seed if arrival.seed is not None else tgi.draw_seed(req)
    job = tgi.to_job(req, model=model, seed=seed, stream=streaming, adapters=info.adapters,
                     job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = tgi.TgiRenderer(req, seed=seed, array_body=array_body)
    return Plan(name, arrival, job, renderer, streaming, "tgi")


def checked(planner: Planner) -> Planner:
    """The planner, with the schema and pattern checks its format code deferred (schema_checks.deferring) made
    off the loop once the job is built: a refusal comes before anything is charged or queued. A resumed stream's
    body passed them when the stream began."""
    async def plan(request: web.Request, body: bytes, given: Arrival | None) -> Plan:
        with schema_checks.deferring() as pending:
            made = await planner(request, body, given)
        if given is None:
            await request.app[CHECKER].run(pending, caller_of(request).tenant)
        return made
    return plan


PLANNERS: dict[str, Planner] = {
    "chat": checked(plan_chat),
    "completions": checked(plan_completions),
    "completions_templated": checked(functools.partial(plan_completions, raw_prompt_default=False)),
    "responses": checked(plan_responses),
    "responses_ovms": checked(functools.partial(plan_responses, ovms=True)),
    "embeddings": plan_embeddings,
    "tgi": checked(functools.partial(plan_tgi, stream=False)),
    "tgi_stream": checked(functools.partial(plan_tgi, stream=True, name="tgi_stream")),
    "tgi_compat": checked(functools.partial(plan_tgi, stream=None, array_body=True, name="tgi_compat")),
}
"""Every planner by name: a stored StreamRecord names the one that made its plan."""
