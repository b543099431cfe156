"""The pure planners: how each generation format turns a request body into a job and the renderer of its answer.

A planner does no I/O and reads no app state. What only I/O can give (the model's heartbeat behind the caller's key
check, the conversation a Responses turn continues, room in the store, the request's arrival) it asks its caller
for: it is a generator that yields a `Need` and is sent back the answer. So its checks run in the order a request's
refusals must come (a body that does not decode is a 400 before its model is looked up, a context too long for the
model is refused before the store is read), one caller (services.edge.plans) does all the I/O, and a test can drive
a planner with answers of its own.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgspec

from services.edge.formats import (
    chat,
    completions,
    conversation_items,
    embeddings,
    item_refs,
    messages,
    messages_render,
    rerank,
    response_render,
    responses,
    tgi,
    tokenize,
)
from services.edge.formats.base import Renderer, decode, unknown_fields
from services.edge.store import Conversation
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, ModelUnavailable, prompt_scores_unavailable

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


# what a planner asks its caller for


@dataclass(frozen=True)
class Ignored:
    """Top-level fields of the body the format does not know (counted per route); answered with None."""

    route: str
    count: int


@dataclass(frozen=True)
class Model:
    """A model the caller's key may use, with a live worker for the task, or an adapter of one; answered with
    the model's bus.WorkerInfo (an adapter's job names it: its planner need not know, see plans.planned)."""

    name: str
    task: str = "generate"
    param: str = "model"
    """Where the request named it (TGI names an adapter in parameters.adapter_id)."""


@dataclass(frozen=True)
class ServedModel:
    """The model the edge serves by default (TGI's requests need not name one); answered with its name."""


@dataclass(frozen=True)
class PreviousTurns:
    """The conversation the stored response `response_id` ended; answered with a store.Conversation."""

    response_id: str


@dataclass(frozen=True)
class ConversationItems:
    """The items of the caller's Conversations-API conversation `conversation_id`; answered with a list of them
    (dicts, oldest first)."""

    conversation_id: str


@dataclass(frozen=True)
class ReferencedItems:
    """The caller's stored items with these ids (see item_refs); answered with the JSON of each found, by id."""

    ids: tuple[str, ...]


@dataclass(frozen=True)
class Room:
    """Room in the caller's storage for a response of `size` bytes (a resumed stream was checked when it began);
    answered with None."""

    size: int


@dataclass(frozen=True)
class Arrive:
    """The request's arrival (a resumed stream's own); answered with an Arrival."""

    prefix: str
    seed: int | None = None


Need = Ignored | Model | ServedModel | PreviousTurns | ConversationItems | ReferencedItems | Room | Arrive


@dataclass(frozen=True)
class Planned:
    job: bus.Job
    renderer: Renderer
    stream: bool
    arrival: Arrival


Planning = Generator[Need, Any, Planned]
"""A planner at work: it yields what it needs, is sent the answer, and returns its plan."""


def advance(planning: Planning, answer: object = None) -> Need | Planned:
    """Sends a planner the answer to what it last asked (None to start it): what it needs next, or its plan."""
    try:
        return planning.send(answer)
    except StopIteration as done:
        planned: Planned = done.value
        return planned


def _decode(body: bytes, kind: type[T], route: str) -> Generator[Need, Any, T]:
    parsed = decode(body, kind)
    if ignored := unknown_fields(body, kind):
        yield Ignored(route, len(ignored))
    return parsed


def _model(name: str, task: str = "generate", param: str = "model") -> Generator[Need, Any, bus.WorkerInfo]:
    return cast(bus.WorkerInfo, (yield Model(name, task, param)))


PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})
"""What TGI's clients send as `model` when they name none: TGI's own "tgi" and huggingface_hub's "dummy" (an
InferenceClient made with a URL). TGI serves its one model whatever the name; here it is the edge's --model."""


def _named(model: str) -> Generator[Need, Any, str]:
    """The model a request names, a placeholder standing for the edge's default."""
    if model in PLACEHOLDER_MODELS:
        return cast(str, (yield ServedModel()))
    return model


def _needs(info: bus.WorkerInfo, feature: str, what: str) -> None:
    """A job `what` asks for runs only where every live worker of its model takes `feature` (bus.WORKER_FEATURES):
    an older worker would ignore it and answer wrongly. A 503 to retry: the workers are being upgraded."""
    if feature not in info.features:
        raise ModelUnavailable(f"The workers of `{info.model}` are older than this server and cannot serve {what} "
                               "yet: upgrade the workers (before the edges).")


def _scores_prompts(info: bus.WorkerInfo, param: str) -> None:
    """A job that asks for its prompt's logprobs runs only where every live worker of its model scores prompts
    (bus.PROMPT_SCORES: none with LoRA adapters enabled)."""
    if bus.PROMPT_SCORES not in info.features:
        raise prompt_scores_unavailable(info.model, param)


def _arrive(prefix: str, seed: int | None = None) -> Generator[Need, Any, Arrival]:
    return cast(Arrival, (yield Arrive(prefix, seed)))


def plan_chat(body: bytes) -> Planning:
    req = yield from _decode(body, chat.ChatCompletionRequest, "chat")
    req.model = yield from _named(req.model)
    info = yield from _model(req.model)
    chat.check_context(req, info.max_model_len)
    arrival = yield from _arrive("chatcmpl-")
    job = chat.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = chat.ChatRenderer(req, response_id=arrival.job_id, created=arrival.created)
    return Planned(job, renderer, req.stream, arrival)


def plan_messages(body: bytes) -> Planning:
    """Anthropic's Messages API."""
    req = yield from _decode(body, messages.MessagesRequest, "messages")
    messages.check_length(req)
    info = yield from _model(req.model)
    messages.check_context(req, info.max_model_len)
    arrival = yield from _arrive("msg_")
    job = messages.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = messages_render.MessagesRenderer(req, message_id=arrival.job_id,
                                                input_estimate=messages.input_estimate(job, info.max_model_len))
    return Planned(job, renderer, req.stream, arrival)


def plan_count_tokens(body: bytes) -> Planning:
    """Anthropic's count_tokens: the worker renders and counts the prompt, and runs nothing."""
    req = yield from _decode(body, messages.CountTokensRequest, "messages")
    messages.check_length(req)
    yield from _model(req.model)
    arrival = yield from _arrive("count_")
    job = messages.count_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    return Planned(job, messages_render.count_renderer(), False, arrival)


def plan_completions(body: bytes, raw_prompt_default: bool = True) -> Planning:
    req = yield from _decode(body, completions.CompletionRequest, "completions")
    if not raw_prompt_default:  # Databricks' completions: the chat template, and no token limit by default
        if req.use_raw_prompt is None and not completions.split_prompt(req)[1]:  # token ids run as given
            req.use_raw_prompt = False
        if "max_tokens" not in msgspec.json.decode(body, type=dict[str, msgspec.Raw]):
            req.max_tokens = None
    req.model = yield from _named(req.model)
    info = yield from _model(req.model)
    if completions.split_prompt(req)[1]:
        _needs(info, "prompt_ids", "prompts of token ids")
    if req.echo and req.logprobs is not None:
        _scores_prompts(info, "logprobs")
    completions.check_context(req, info.max_model_len)
    arrival = yield from _arrive("cmpl-")
    job = completions.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to,
                             deadline_ms=arrival.deadline_ms)
    renderer = completions.CompletionRenderer(req, response_id=arrival.job_id, created=arrival.created)
    return Planned(job, renderer, req.stream, arrival)


def plan_responses(body: bytes, ovms: bool = False) -> Planning:
    """OpenAI Responses; `ovms`: as OVMS serves it on /v3 (see ResponsesRenderer.ovms)."""
    req = yield from _decode(body, responses.ResponsesRequest, "responses")
    responses.refuse_unsupported(req)
    info = yield from _model(req.model)
    responses.check_context(req, info.max_model_len)
    req, conversation, conversation_id, added = yield from _turn(req)
    if req.store or conversation_id:
        yield Room(len(body))
    arrival = yield from _arrive("resp_")
    # its input items, as the response lists them and its conversation keeps them: new ids name the response
    kept = req.store or conversation_id
    new_items = conversation_items.listed(responses.input_items(req), home=arrival.job_id) if kept else []
    job = responses.to_job(req, conversation.history + added, job_id=arrival.job_id, reply_to=arrival.reply_to,
                           deadline_ms=arrival.deadline_ms)
    renderer = response_render.ResponsesRenderer(req, response_id=arrival.job_id, created_at=arrival.created,
                                                  conversation=conversation, added=added, ovms=ovms,
                                                  conversation_id=conversation_id or "", new_items=new_items)
    return Planned(job, renderer, req.stream, arrival)


def _turn(req: responses.ResponsesRequest) -> Generator[
        Need, Any, tuple[responses.ResponsesRequest, Conversation, str | None, list[bus.Message]]]:
    """The turn a Responses request runs: the request with the items its input references in their place, the
    conversation it continues (a Conversations-API one, checked to take this turn's items, or the responses
    before `previous_response_id`) and its input as messages."""
    if wanted := item_refs.references(responses.input_items(req)):
        found = cast(dict[str, bytes], (yield ReferencedItems(tuple(wanted))))
        req = msgspec.structs.replace(req, input=item_refs.resolved(responses.input_items(req), found))
    conversation = Conversation()
    if conversation_id := responses.conversation_id(req):
        items = cast(list[dict[str, Any]], (yield ConversationItems(conversation_id)))
        conversation = Conversation(history=conversation_items.history(items))
        conversation_items.check_added(responses.input_items(req), items, field="input")
    elif req.previous_response_id:
        conversation = cast(Conversation, (yield PreviousTurns(req.previous_response_id)))
    added = responses.input_messages(req, conversation.history)
    responses.check_length(req, conversation, added)
    return req, conversation, conversation_id, added


def plan_response_input_tokens(body: bytes) -> Planning:
    """POST /v1/responses/input_tokens: the worker renders the turn's prompt (instructions, the conversation it
    continues, tools) and counts it, running nothing (one output token in its budget, as count_tokens)."""
    counted = yield from _decode(body, responses.InputTokensRequest, "responses")
    req = responses.counted_request(counted, (yield from _served(counted.model)))
    responses.refuse_unsupported(req)
    yield from _model(req.model)
    req, conversation, _, added = yield from _turn(req)
    arrival = yield from _arrive("count_")
    job = responses.to_job(req, conversation.history + added, job_id=arrival.job_id, reply_to=arrival.reply_to,
                           deadline_ms=arrival.deadline_ms)
    job = msgspec.structs.replace(job, count_only=True, params=bus.SamplingParams(max_tokens=1))
    return Planned(job, response_render.input_tokens_renderer(), False, arrival)


def plan_tokenize(body: bytes) -> Planning:
    """POST /tokenize: TGI's (a body with `inputs`: each token with its span), else vLLM's (a `prompt`, or
    `messages` through the chat template)."""
    fields = decode(body, dict[str, msgspec.Raw])
    if "inputs" in fields:
        req = yield from _decode(body, tgi.GenerateRequest, "tgi")
        text = tgi.input_text(req.inputs)
        if not text:
            raise InvalidRequest("`inputs` is the text to tokenize.", param="inputs")
        model = yield from _served(req.model or "")
        _needs((yield from _model(model)), "tokens_out", "/tokenize")
        arrival = yield from _arrive("tok-")
        job = tokenize.prompt_job(tokenize.TokenizePromptRequest(model=model, prompt=text), **_ids(arrival))
        return Planned(job, tokenize.tgi_tokenized(text, tgi.tgi_error_body), False, arrival)
    vllm_req: tokenize.TokenizeChatRequest | tokenize.TokenizePromptRequest
    if "messages" in fields:
        vllm_req = yield from _decode(body, tokenize.TokenizeChatRequest, "tokenize")
    else:
        vllm_req = yield from _decode(body, tokenize.TokenizePromptRequest, "tokenize")
    vllm_req.model = yield from _served(vllm_req.model)
    info = yield from _model(vllm_req.model)
    _needs(info, "tokens_out", "/tokenize")
    arrival = yield from _arrive("tok-")
    job = (tokenize.chat_job(vllm_req, **_ids(arrival)) if isinstance(vllm_req, tokenize.TokenizeChatRequest)
           else tokenize.prompt_job(vllm_req, **_ids(arrival)))
    return Planned(job, tokenize.tokenized(info.max_model_len, vllm_req.return_token_strs), False, arrival)


def plan_detokenize(body: bytes) -> Planning:
    """vLLM's POST /detokenize: the text of token ids."""
    req = yield from _decode(body, tokenize.DetokenizeRequest, "tokenize")
    req.model = yield from _served(req.model)
    _needs((yield from _model(req.model)), "tokens_out", "/detokenize")
    arrival = yield from _arrive("tok-")
    return Planned(tokenize.ids_job(req, **_ids(arrival)), tokenize.detokenized(), False, arrival)


def _served(model: str) -> Generator[Need, Any, str]:
    """The model a request names; none, or a placeholder, is the edge's."""
    return (yield from _named(model)) if model else cast(str, (yield ServedModel()))


def _ids(arrival: Arrival) -> dict[str, Any]:
    return {"job_id": arrival.job_id, "reply_to": arrival.reply_to, "deadline_ms": arrival.deadline_ms}


def plan_embeddings(body: bytes) -> Planning:
    req = yield from _decode(body, embeddings.EmbeddingRequest, "embeddings")
    info = yield from _model(req.model, task="embed")
    embeddings.check_dimensions(req, info.dimensions)
    embeddings.check_size(req, info.dimensions)
    arrival = yield from _arrive("embd-")
    job = embeddings.to_job(req, job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    return Planned(job, embeddings.EmbeddingRenderer(req, arrival.job_id), False, arrival)


def plan_rerank(body: bytes) -> Planning:
    """Rerank (Jina / vLLM, Cohere, OVMS): a cross-encoder's score of each (query, document) pair, or over an
    embedding model the cosine of the query's and the document's vectors."""
    req = yield from _decode(body, rerank.RerankRequest, "rerank")
    info = yield from _model(req.model, task=rerank.RANKING_TASKS)
    texts, pairs = rerank.rerank_pairs(req)
    rerank.check_size(texts, pairs, info)
    arrival = yield from _arrive("rerank-")
    job = rerank.scoring_job(req.model, texts, pairs, info, job_id=arrival.job_id, reply_to=arrival.reply_to,
                             deadline_ms=arrival.deadline_ms)
    return Planned(job, rerank.RerankRenderer(req, arrival.job_id, cross=bool(job.pairs)), False, arrival)


def plan_score(body: bytes) -> Planning:
    """vLLM's score: each pair read together by a cross-encoder, or the cosine of its two embeddings."""
    req = yield from _decode(body, rerank.ScoreRequest, "score")
    info = yield from _model(req.model, task=rerank.RANKING_TASKS)
    texts, pairs = rerank.pairs_of(req)
    rerank.check_size(texts, pairs, info)
    arrival = yield from _arrive("score-")
    job = rerank.scoring_job(req.model, texts, pairs, info, job_id=arrival.job_id, reply_to=arrival.reply_to,
                             deadline_ms=arrival.deadline_ms)
    return Planned(job, rerank.ScoreRenderer(req, arrival.job_id, arrival.created, cross=bool(job.pairs)), False,
                   arrival)


def plan_tgi(body: bytes, *, stream: bool | None, array_body: bool = False) -> Planning:
    """TGI / MindIE; `stream` None: the body's `stream` decides (the `/` route)."""
    req = yield from _decode(body, tgi.GenerateRequest, "tgi")
    streaming = req.stream if stream is None else stream
    model = req.model or cast(str, (yield ServedModel()))
    if adapter := tgi.adapter_of(req):  # TGI's multi-LoRA: the adapter of the served model
        info = yield from _model(adapter, param="parameters.adapter_id")
        tgi.check_adapter(adapter, info.model, model)
    else:
        info = yield from _model(model)
    if req.parameters.decoder_input_details and not streaming:  # with a stream it is refused as TGI refuses it
        _scores_prompts(info, "parameters.decoder_input_details")
    tgi.check_context(req, info.max_model_len)
    arrival = yield from _arrive("gen-", seed=tgi.draw_seed(req))
    seed = arrival.seed if arrival.seed is not None else tgi.draw_seed(req)
    job = tgi.to_job(req, model=adapter or model, seed=seed, stream=streaming,
                     job_id=arrival.job_id, reply_to=arrival.reply_to, deadline_ms=arrival.deadline_ms)
    renderer = tgi.TgiRenderer(req, seed=seed, array_body=array_body)
    return Planned(job, renderer, streaming, arrival)
