"""How each generation route turns a request body into a job and the renderer of its answer: a plan.

The formats' pure planners (services.edge.formats.planners) make it; this is the one place that does their I/O:
the model lookup behind the caller's key check, the conversation a Responses turn continues and the room to store
it, the arrival, and then the schema checks the format code deferred. A plan depends only on the body and the
request's arrival (id, creation time, seed), so any edge can make the same plan again from a stored `StreamRecord`
and render a resumed stream exactly as it began.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from services.edge import schema_checks
from services.edge.auth import Caller
from services.edge.formats import item_refs, planners
from services.edge.formats.base import Renderer
from services.edge.formats.planners import Arrival, Planning
from services.edge.state import CHECKER, CONVERSATIONS, GATEWAY, SETTINGS, STORE
from services.edge.store import REFERENCED_BODIES
from shared.protocol import bus
from shared.protocol.errors import PreviousResponseNotFound
from shared.runtime import metrics
from shared.tenancy.adapters import Adapter


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


_record_decoder = msgspec.msgpack.Decoder(StreamRecord)


def decode_record(raw: bytes) -> StreamRecord:
    """A StreamRecord as Redis keeps it (keys.job_record)."""
    return _record_decoder.decode(raw)


Planner = Callable[[web.Application, Caller, bytes, Arrival | None], Awaitable[Plan]]
"""Makes a plan for a caller from a body, with the edge's state (`app`); a resumed job passes its arrival."""


def arrive(app: web.Application, prefix: str, seed: int | None = None) -> Arrival:
    timeout_s = app[SETTINGS].request_timeout_s
    return Arrival(job_id=f"{prefix}{uuid.uuid4().hex}", started=time.monotonic(),
                   deadline_ms=bus.now_ms() + int(timeout_s * 1000),
                   reply_to=app[GATEWAY].relay.channel, created=int(time.time()), seed=seed)


async def _answer(app: web.Application, caller: Caller, need: planners.Need, given: Arrival | None,
                  adapters: dict[str, Adapter]) -> object:
    """What a planner asked for (see services.edge.formats.planners); `given`: a resumed stream's arrival; an
    adapter a Model need named goes into `adapters`."""
    match need:
        case planners.Ignored(route, count):
            metrics.UNKNOWN_FIELDS.labels(route).inc(count)
        case planners.Model():
            return await _model(app, caller, need, adapters)
        case planners.ServedModel():
            return app[SETTINGS].model
        case planners.ConversationItems() | planners.PreviousTurns() | planners.ReferencedItems():
            return await _stored(app, caller, need)
        case planners.Room(size):
            if given is None:  # a resumed stream was checked when it began
                await app[STORE].check_room(caller.tenant, caller.key, size)
        case planners.Arrive(prefix, seed):
            return given or arrive(app, prefix, seed=seed)
    return None


async def _stored(app: web.Application, caller: Caller,
                  need: planners.ConversationItems | planners.PreviousTurns | planners.ReferencedItems) -> object:
    """What the caller has stored that a Responses turn continues or references."""
    match need:
        case planners.ConversationItems(conversation_id):
            return (await app[CONVERSATIONS].load(caller.tenant, conversation_id, param="conversation"))[0].items
        case planners.PreviousTurns(response_id):
            found = await app[STORE].conversation(caller.tenant, response_id)
            if found is None:
                raise PreviousResponseNotFound(f"Previous response with id '{response_id}' not found.",
                                               param="previous_response_id")
            return found
    return await referenced(app, caller.tenant, need.ids)


async def referenced(app: web.Application, tenant: str, ids: list[str] | tuple[str, ...], field: str = "input"
                     ) -> dict[str, bytes]:
    """The tenant's stored items with these ids that are found, each as its JSON (see formats.item_refs): the
    responses they are of come to at most REFERENCED_BODIES request bodies, and the conversations the others were
    added to at most REFERENCED_BODIES conversations, else a 400 naming `field`."""
    found = await app[STORE].items(tenant, item_refs.homes(ids), REFERENCED_BODIES * app[SETTINGS].max_body_bytes,
                                   field)
    return found | await app[CONVERSATIONS].items(tenant, item_refs.conversations(ids), REFERENCED_BODIES, field)


async def _model(app: web.Application, caller: Caller, need: planners.Model, adapters: dict[str, Adapter]
                 ) -> bus.WorkerInfo:
    caller.check_model(need.name, need.param)  # a model the caller's key may not use is a 404, as a missing one
    info, adapter = await app[GATEWAY].require_model(need.name, need.task, caller.sees, need.param)
    if adapter is not None:
        adapters[need.name] = adapter
    return info


def planned(name: str, route: str, plan: Callable[[bytes], Planning]) -> Planner:
    """Serves a pure planner: answers what it asks for; the plan it returns is named `name` (what a StreamRecord
    keeps) and counted under `route`."""
    async def run(app: web.Application, caller: Caller, body: bytes, given: Arrival | None) -> Plan:
        planning = plan(body)
        adapters: dict[str, Adapter] = {}
        step = planners.advance(planning)
        while not isinstance(step, planners.Planned):
            step = planners.advance(planning, await _answer(app, caller, step, given, adapters))
        return Plan(name, step.arrival, _on_adapter(step.job, adapters), step.renderer, step.stream, route)
    return run


def _on_adapter(job: bus.Job, adapters: dict[str, Adapter]) -> bus.Job:
    """A job for an adapter goes to its base model's workers, with the adapter to run and where to load it from
    (its answer still names the adapter: the renderer has the request's `model`)."""
    if (adapter := adapters.get(job.model)) is None:
        return job
    return msgspec.structs.replace(job, model=adapter.base, adapter=adapter.name, adapter_path=adapter.path)


def checked(planner: Planner) -> Planner:
    """The planner, with the schema and pattern checks its format code deferred (schema_checks.deferring) made
    off the loop once the job is built: a refusal comes before anything is charged or queued. A resumed stream's
    body passed them when the stream began."""
    async def plan(app: web.Application, caller: Caller, body: bytes, given: Arrival | None) -> Plan:
        with schema_checks.deferring() as pending:
            made = await planner(app, caller, body, given)
        if given is None:
            await app[CHECKER].run(pending, caller.tenant)
        return made
    return plan


PLANNERS: dict[str, Planner] = {
    "chat": checked(planned("chat", "chat", planners.plan_chat)),
    "completions": checked(planned("completions", "completions", planners.plan_completions)),
    "completions_templated": checked(planned("completions_templated", "completions", functools.partial(
        planners.plan_completions, raw_prompt_default=False))),
    "responses": checked(planned("responses", "responses", planners.plan_responses)),
    "responses_ovms": checked(planned("responses_ovms", "responses", functools.partial(
        planners.plan_responses, ovms=True))),
    "responses_input_tokens": checked(planned("responses_input_tokens", "responses",
                                              planners.plan_response_input_tokens)),
    "tokenize": checked(planned("tokenize", "tokenize", planners.plan_tokenize)),
    "detokenize": planned("detokenize", "tokenize", planners.plan_detokenize),
    "embeddings": planned("embeddings", "embeddings", planners.plan_embeddings),
    "messages": checked(planned("messages", "messages", planners.plan_messages)),
    "messages_count": checked(planned("messages_count", "messages", planners.plan_count_tokens)),
    "rerank": planned("rerank", "rerank", planners.plan_rerank),
    "score": planned("score", "score", planners.plan_score),
    "tgi": checked(planned("tgi", "tgi", functools.partial(planners.plan_tgi, stream=False))),
    "tgi_stream": checked(planned("tgi_stream", "tgi", functools.partial(planners.plan_tgi, stream=True))),
    "tgi_compat": checked(planned("tgi_compat", "tgi", functools.partial(
        planners.plan_tgi, stream=None, array_body=True))),
}
"""Every planner by name: a stored StreamRecord names the one that made its plan."""
