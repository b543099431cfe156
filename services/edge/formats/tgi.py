"""Hugging Face TGI / Huawei MindIE text generation: /generate, /generate_stream, / and /info.

Validation errors are 422 and overload 429, as in TGI; requests we understand but cannot serve
(images for a text model, an unknown adapter, prefill details while streaming) are 400s that name the
parameter. `typical_p` and `watermark` are accepted and not applied, as MindIE documents them.
"""

from __future__ import annotations

import random
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from services.edge.formats import structured
from services.edge.formats.base import (
    Out,
    Payload,
    Request,
    StopList,
    StopString,
    Unstored,
    encode,
    refuse,
    refuse_beyond_context,
    stop_list,
)
from shared.protocol import bus
from shared.protocol.errors import (
    AdapterUnavailable,
    ContextLengthExceeded,
    EngineError,
    InvalidRequest,
    MethodNotAllowed,
    ModelUnavailable,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    TokenbusError,
    Unavailable,
    WorkerLost,
)

MAX_INPUT_CHARS = 4 * 1024 * 1024
"""MindIE accepts up to 4 MB of text in `inputs`."""
MAX_SEED = 2**64 - 1
ENGINE_SEED_SPACE = 2**63
"""The engine's seeds are signed 64-bit: larger TGI seeds are folded into that range, the same way each time."""
NO_ADAPTER = "None"
DEFAULT_NEW_TOKENS = 20
"""MindIE's default max_new_tokens."""
MAX_FACTOR = 100.0
"""The most `repetition_penalty` may be (neither TGI nor vLLM sets a bound): beyond float32's range (3.4e38) the
engine divides logits by infinity, and a logit of 0 times an infinite penalty is NaN, which sampling fails on."""


class Parameters(Request):
    max_new_tokens: Annotated[int, Meta(gt=0, le=2147483647)] | None = DEFAULT_NEW_TOKENS
    """None (TGI's schema lets a client send null): the default."""
    do_sample: bool | None = None
    temperature: Annotated[float, Meta(gt=1e-6, le=2.0)] | None = None
    """TGI sets no upper bound; vLLM refuses more than 2 (here, at once: not after the job waited for a slot)."""
    top_k: Annotated[int, Meta(gt=0, le=2147483647)] | None = None
    top_p: Annotated[float, Meta(gt=1e-6, lt=1.0)] | None = None
    typical_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_FACTOR)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Meta(gt=0)] | None = None
    """Up to 2**64 - 1, the most a JSON integer decodes to here."""
    stop: StopString | StopList | None = None
    truncate: Annotated[int, Meta(gt=0, le=2147483647)] | None = None
    return_full_text: bool | None = False
    details: bool = False
    decoder_input_details: bool = False
    watermark: bool = False
    adapter_id: Annotated[str, Meta(max_length=256, pattern=r"^[A-Za-z0-9._/-]+$")] | None = None
    top_n_tokens: Annotated[int, Meta(ge=0, le=5)] | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None
    grammar: structured.Grammar | None = None


class GenerateRequest(Request):
    inputs: Annotated[str, Meta(min_length=1, max_length=MAX_INPUT_CHARS)] | list[Any]
    parameters: Parameters = msgspec.field(default_factory=Parameters)
    stream: bool = False
    model: str | None = None
    """Our extension: which served model answers (default: the edge's --model)."""


def new_tokens(p: Parameters) -> int:
    return DEFAULT_NEW_TOKENS if p.max_new_tokens is None else p.max_new_tokens


def input_text(inputs: str | list[Any]) -> str | None:
    """The text of `inputs`: the string, or MindIE's list of `{"type": "text", "text"}` items joined; None
    when the list holds anything but text."""
    if isinstance(inputs, str):
        return inputs
    texts = [text for item in inputs if isinstance(item, dict) and item.get("type") == "text"
             and isinstance(text := item.get("text"), str)]
    joined = "".join(texts)
    return joined if joined and len(texts) == len(inputs) else None


def adapter_of(req: GenerateRequest) -> str | None:
    """The LoRA adapter the request names (parameters.adapter_id; "None" names the base model)."""
    adapter = req.parameters.adapter_id
    return None if adapter in (None, NO_ADAPTER) else adapter


def check_adapter(adapter: str, base: str, model: str) -> None:
    """The adapter must be one of the model the request runs on."""
    if base != model:
        raise InvalidRequest(f"The adapter `{adapter}` is not one of `{model}`.", param="parameters.adapter_id",
                             code="unknown_adapter")


def _refuse_unsupported(req: GenerateRequest, stream: bool) -> None:
    p = req.parameters
    if p.seed is not None and p.seed > MAX_SEED:
        raise InvalidRequest(f"`parameters.seed` must be at most {MAX_SEED}.", param="parameters.seed")
    if not isinstance(req.inputs, str) and input_text(req.inputs) is None:
        raise refuse("inputs", "this model reads text only; send `inputs` as a string or text items "
                     "(nothing was fetched)")
    if p.decoder_input_details and stream:
        raise refuse("parameters.decoder_input_details", "prefill details cannot be streamed")
    if p.best_of not in (None, 1):
        raise refuse("parameters.best_of", "only best_of=1 is served")


def check_context(req: GenerateRequest, max_model_len: int) -> None:
    """max_new_tokens must leave room for the inputs, as TGI's max_total_tokens demands."""
    refuse_beyond_context(new_tokens(req.parameters), max_model_len, "parameters.max_new_tokens")


def draw_seed(req: GenerateRequest) -> int:
    """The seed the request runs with: its own, or one drawn now (and returned in the details)."""
    return req.parameters.seed or random.randint(1, MAX_SEED)  # nosec B311: a sampling seed, not a secret


def to_job(
    req: GenerateRequest, *, model: str, seed: int, stream: bool, job_id: str, reply_to: str, deadline_ms: int,
) -> bus.Job:
    _refuse_unsupported(req, stream)
    p = req.parameters
    sampling = p.do_sample if p.do_sample is not None else any(
        v is not None for v in (p.temperature, p.top_k, p.top_p))
    per_token = stream or p.details or p.decoder_input_details
    params = bus.SamplingParams(
        max_tokens=new_tokens(p),
        temperature=(p.temperature or 1.0) if sampling else 0.0,
        top_p=p.top_p or 1.0,
        top_k=p.top_k or 0,
        seed=seed % ENGINE_SEED_SPACE,
        stop=stop_list(p.stop, "parameters.stop"),
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        logprobs=(p.top_n_tokens or 0) if per_token else None,
        prompt_logprobs=(p.top_n_tokens or 0) if p.decoder_input_details else None,
        constraint=structured.of_grammar(p.grammar),
    )
    return bus.Job(id=job_id, model=model, reply_to=reply_to, deadline_ms=deadline_ms, kind="completion",
                   prompts=[input_text(req.inputs) or ""], keep_last_tokens=p.truncate or 0, params=params,
                   created_ms=bus.now_ms())


# response


class Token(Out):
    id: int
    text: str
    logprob: float
    special: bool


class PrefillToken(Out):
    id: int
    text: str
    logprob: float | None


class Details(Out, kw_only=True):
    finish_reason: str
    generated_tokens: int
    prompt_tokens: int
    seed: int
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | UnsetType = UNSET


class GenerateResponse(Out, kw_only=True):
    generated_text: str
    details: Details | UnsetType = UNSET


class StreamDetails(Out, kw_only=True):
    finish_reason: str
    generated_tokens: int
    input_length: int
    prompt_tokens: int
    seed: int


class StreamResponse(Out, kw_only=True):
    index: int
    token: Token
    top_tokens: list[Token] | UnsetType = UNSET
    generated_text: str | None = None
    details: StreamDetails | None = None


class Info(Out, kw_only=True):
    model_id: str
    model_dtype: str = "float32"
    model_device_type: str = "cpu"
    model_pipeline_tag: str = "text-generation"
    max_concurrent_requests: int
    max_best_of: int = 1
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int = 1
    max_client_batch_size: int = 1
    router: str = "tokenbus"
    version: str


class ErrorBody(Out):
    error: str
    error_type: str


def finish_reason(reason: str | None, stop_reason: str | int | None) -> str:
    """TGI's words: `length`, `stop_sequence` (a stop string matched) or `eos_token`."""
    if reason == "length":
        return "length"
    return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"


def error_status(error: TokenbusError) -> tuple[int, str]:
    """TGI's status codes and error types: 422 validation, 429 overloaded (TGI's one kind of 429, which its
    clients retry: a key's limits too), 424 generation."""
    if isinstance(error, PayloadTooLarge | MethodNotAllowed):
        return error.status, "validation"
    if error.status == 429:
        return 429, "overloaded"
    if isinstance(error, InvalidRequest) and error.code in ("unsupported_parameter", "unknown_adapter"):
        return 400, "validation"
    if isinstance(error, InvalidRequest | ContextLengthExceeded):
        return 422, "validation"
    if isinstance(error, Unavailable | ModelUnavailable | WorkerLost | AdapterUnavailable):
        return 503, "unavailable"
    if isinstance(error, Overloaded):
        return 429, "overloaded"
    if isinstance(error, NotFound):
        return 404, "not_found"
    if isinstance(error, EngineError):
        return 424, "generation"
    return error.status, error.type


def tgi_error_body(error: TokenbusError) -> ErrorBody:
    return ErrorBody(error=error.message, error_type=error_status(error)[1])


def tgi_error(error: TokenbusError) -> bytes:
    return encode(tgi_error_body(error))


def _tokens(event: bus.Tokens) -> list[tuple[Token, list[Token]]]:
    logprobs = event.logprobs or []
    out = []
    for i, token_id in enumerate(event.token_ids):
        lp = logprobs[i] if i < len(logprobs) else bus.TokenLogprob(token="", logprob=0.0)  # nosec B106: a token's text, not a password
        top = [Token(id=t.token_id, text=t.token, logprob=t.logprob, special=False) for t in lp.top]
        out.append((Token(id=token_id, text=lp.token, logprob=lp.logprob, special=lp.special), top))
    return out


class TgiRenderer(Unstored):
    """TGI's stream: one event per token; the last one carries `generated_text` (and the details)."""

    def __init__(self, req: GenerateRequest, *, seed: int, array_body: bool = False) -> None:
        self.req = req
        self.seed = seed
        self.array_body = array_body
        self.prefix = (input_text(req.inputs) or "") if req.parameters.return_full_text else ""
        self.texts: list[str] = []
        self.tokens: list[Token] = []
        self.top_tokens: list[list[Token]] = []
        self.prefill: list[PrefillToken] = []
        self.reason = "length"
        self.prompt_tokens = 0
        self.held: StreamResponse | None = None
        """The last token's event waits for the job's Final, which brings the prompt length."""

    def _stream_event(self, token: Token, top: list[Token]) -> StreamResponse:
        with_top = self.req.parameters.top_n_tokens
        return StreamResponse(index=len(self.tokens) + 1, token=token,  # TGI counts its events from 1
                              top_tokens=top if with_top else UNSET)

    def render(self, event: bus.Output) -> list[Payload]:
        if isinstance(event, bus.Prompt):
            self.prefill = [PrefillToken(id=event.token_ids[0], text=event.first_token, logprob=None)] + [
                PrefillToken(id=tid, text=lp.token, logprob=lp.logprob)
                for tid, lp in zip(event.token_ids[1:], event.logprobs, strict=False)]
            return []
        if isinstance(event, bus.Final):
            return self._finish(event)
        if not isinstance(event, bus.Tokens):
            return []
        self.texts.append(event.text)
        out: list[Payload] = []
        for token, top in _tokens(event):
            if self.held is not None:
                out.append(self.held)
            self.held = self._stream_event(token, top)
            self.tokens.append(token)
            self.top_tokens.append(top)
        if event.finish_reason is not None:
            self.reason = finish_reason(event.finish_reason, event.stop_reason)
        return out

    def _finish(self, final: bus.Final) -> list[Payload]:
        self.prompt_tokens = final.prompt_tokens
        if self.held is None:
            return []
        self.held.generated_text = self.prefix + "".join(self.texts)
        if self.req.parameters.details:
            self.held.details = StreamDetails(
                finish_reason=self.reason, generated_tokens=len(self.tokens), input_length=final.prompt_tokens,
                prompt_tokens=final.prompt_tokens, seed=self.seed,
            )
        return [self.held]

    def done(self) -> list[Payload]:
        return []

    def error(self, error: TokenbusError) -> list[Payload]:
        return [tgi_error_body(error)]

    def body(self) -> GenerateResponse | list[GenerateResponse]:
        p = self.req.parameters
        details: Details | UnsetType = UNSET
        if p.details or p.decoder_input_details:
            details = Details(
                finish_reason=self.reason, generated_tokens=len(self.tokens),
                prompt_tokens=self.prompt_tokens, seed=self.seed, prefill=self.prefill,
                tokens=self.tokens, top_tokens=self.top_tokens if p.top_n_tokens else UNSET,
            )
        response = GenerateResponse(generated_text=self.prefix + "".join(self.texts), details=details)
        return [response] if self.array_body else response
