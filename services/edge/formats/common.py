"""Request fields and conversions that several OpenAI formats share."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.edge.formats import structured
from services.edge.formats.base import Out, Request, StopList, StopString, stop_list
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

def page_limit(given: str, maximum: int) -> int:
    """A list endpoint's `limit` query parameter: a whole number from 1 to `maximum` (leading zeros allowed, any
    number of digits refused without converting them)."""
    digits = given.lstrip("0") if given.isascii() and given.isdigit() else ""
    if not digits or len(digits) > len(str(maximum)) or int(digits) > maximum:
        raise InvalidRequest(f"`limit` must be a whole number from 1 to {maximum}.", param="limit")
    return int(digits)


Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(ge=0, le=1)]
"""OpenAI allows 0 (the most likely token alone); vLLM takes more than 0, so 0 runs as top_k 1."""
Penalty = Annotated[float, Meta(ge=-2, le=2)]
PositiveInt = Annotated[int, Meta(gt=0, le=INT64_MAX)]
"""Token budgets: anything the bus can carry; the edge refuses those beyond the model's context."""
TopK = Annotated[int, Meta(ge=-1, le=INT32_MAX)]
"""vLLM's extension: 0 or -1 means no top-k filtering."""
Seed = Annotated[int, Meta(ge=-(2**63), le=INT64_MAX)]
"""A signed 64-bit integer, as in OpenAI's schema and vLLM's (torch's) generators."""
RepetitionPenalty = Annotated[float, Meta(gt=0, le=2)]
N = Annotated[int, Meta(ge=1, le=16)]
MAX_LOGIT_BIAS = 300
MAX_CACHE_KEY = 1024
"""OpenAI's cap on `logit_bias` entries: each one is a row the engine applies at every step."""
LogitBias = Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)]


RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tools", "documents"})
"""What the worker sets itself when it applies the chat template: a client may not override these."""
TemplateKwargs = Annotated[dict[Annotated[str, Meta(max_length=64)], Any], Meta(max_length=32)]


def template_kwargs(given: dict[str, Any] | None, **implied: Any) -> dict[str, Any]:
    """`chat_template_kwargs` for the worker's chat template (with what other fields imply, such as a
    reasoning effort); the keys the worker sets itself are refused by name."""
    if given and (reserved := sorted(RESERVED_TEMPLATE_KWARGS & given.keys())):
        raise InvalidRequest(f"`chat_template_kwargs` may not set {', '.join(reserved)}: the server sets them.",
                             param=f"chat_template_kwargs.{reserved[0]}")
    try:
        msgspec.msgpack.encode(given)
    except OverflowError:  # the job crosses the bus as msgpack, whose integers have 64 bits
        raise InvalidRequest("`chat_template_kwargs` holds an integer beyond 64 bits.",
                             param="chat_template_kwargs") from None
    return {**{k: v for k, v in implied.items() if v is not None}, **(given or {})}


class StreamOptions(Request):
    include_usage: bool = False


class Sampling(Request):
    """The sampling and streaming fields Chat Completions and Completions share (with vLLM's extras)."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_cache_key: Annotated[str, Meta(max_length=MAX_CACHE_KEY)] | None = None
    """OpenAI's hint that requests share a prefix: those with the same key (of one tenant) go to a worker that ran
    one of them when it has room (cache-aware dispatch)."""
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    stop: StopString | StopList | None = None
    seed: Seed | None = None
    n: N = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-sequence token."""
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0
    """vLLM's extension: the fewest tokens to generate before a stop can end the choice."""
    structured_outputs: structured.StructuredOutputs | None = None
    """vLLM's extension: a regex, a choice, a JSON schema or any JSON object the answer is held to."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def sampling_params(
    req: Sampling, *, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> bus.SamplingParams:
    """The engine-neutral sampling of a request; absent fields take OpenAI's defaults. What vLLM refuses is
    refused here, at once, not once the job has waited for a worker's slot."""
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequest(f"`min_tokens` ({req.min_tokens}) must not exceed the most tokens the request allows "
                             f"({max_tokens}).", param="min_tokens")
    return bus.SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if not req.top_p else req.top_p,
        top_k=1 if req.top_p == 0 else max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop_list(req.stop),
        n=req.n,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias(req.logit_bias),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )


def _is_token_id(key: str) -> bool:
    # isascii: str.isdigit() also accepts digits such as '²' that int() refuses; the length check keeps
    # int() clear of Python's limit on digits and the value within what the engine indexes
    return key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= INT32_MAX


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's token-id strings to ints, each bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (_is_token_id(key) and -100 <= value <= 100):
            raise InvalidRequest(
                f"`logit_bias` maps token ids to biases in [-100, 100]; {key!r}: {value!r} is not one.",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


class TopLogprobOut(Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


def token_logprobs_out(logprobs: list[bus.TokenLogprob]) -> list[TokenLogprobOut]:
    """The chat (and Responses) logprob shape: token, logprob, UTF-8 bytes, top alternatives."""
    return [
        TokenLogprobOut(
            token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
            top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                          for t in lp.top],
        )
        for lp in logprobs
    ]
