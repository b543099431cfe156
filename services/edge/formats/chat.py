"""OpenAI Chat Completions: the request structs, the job they become, and the chunk renderer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, UnsetType

from services.edge.formats.base import (
    Choices,
    Out,
    Request,
    StopList,
    StopString,
    Usage,
    encode,
    openai_error,
    refuse,
    stop_list,
)
from shared import bus
from shared.errors import InvalidRequest, TokenbusError

# request


class ContentPart(Request):
    type: str
    text: str | None = None


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(Request):
    include_usage: bool = False


class ResponseFormat(Request):
    type: str


Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
PositiveInt = Annotated[int, Meta(gt=0)]


class ChatCompletionRequest(Request):
    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    """vLLM's extension: 0 or -1 means no top-k filtering."""
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    stop: StopString | StopList | None = None
    seed: int | None = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    user: str | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-sequence token."""
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    """vLLM's extension: the fewest tokens to generate before a stop can end the choice."""


def _text_of(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"Content parts of type {part.type!r} are not supported by this text model; use 'text'.",
                param=f"messages[{index}].content[{j}].type",
            )
        texts.append(part.text)
    return "".join(texts)


def _refuse_unsupported(req: ChatCompletionRequest) -> None:
    if req.n != 1:
        raise refuse("n", "only n=1 is served for chat completions yet")
    if req.logprobs or req.top_logprobs:
        raise refuse("logprobs", "log probabilities are not served for chat completions yet")
    if req.logit_bias:
        raise refuse("logit_bias", "it is not served yet")
    if req.tools:
        raise refuse("tools", "tool calling is not served yet")
    if req.response_format is not None and req.response_format.type != "text":
        raise refuse("response_format", "only the 'text' format is served yet")


def to_job(req: ChatCompletionRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    """Validates what the schema cannot express and builds the internal job."""
    _refuse_unsupported(req)
    messages = [
        bus.Message(role="system" if m.role == "developer" else m.role, content=_text_of(m, i))
        for i, m in enumerate(req.messages)
    ]
    params = bus.SamplingParams(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=stop_list(req.stop),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat",
        messages=messages, params=params, created_ms=bus.now_ms(),
    )


# response


class Delta(Out, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChunkChoice(Out, kw_only=True):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Out, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | UnsetType | None = UNSET


class ResponseMessage(Out, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None


class Choice(Out, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(Out, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[Choice]
    usage: Usage


class ChatRenderer:
    """Chat Completions as a state machine: a role chunk, content chunks, a finish chunk, usage."""

    def __init__(self, req: ChatCompletionRequest, *, response_id: str, created: int) -> None:
        self.id = response_id
        self.created = created
        self.model = req.model
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.choices = Choices(req.n)
        self.started = [False] * req.n

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | UnsetType | None = UNSET) -> bytes:
        if usage is UNSET and self.include_usage:
            usage = None
        return encode(ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
        ))

    def frames(self, event: bus.Tokens | bus.Final) -> list[bytes]:
        if isinstance(event, bus.Final):
            usage = self.choices.finish(event)
            return [self._chunk([], usage)] if self.include_usage else []
        self.choices.add(event)
        out: list[bytes] = []
        i = event.choice
        if not self.started[i]:
            self.started[i] = True
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))]))
        if event.text:
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(content=event.text))]))
        if event.finish_reason is not None:
            reason = _finish_reason(event.finish_reason)
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=reason)]))
        return out

    def done(self) -> list[bytes]:
        return [b"[DONE]"]

    def error(self, error: TokenbusError) -> list[bytes]:
        return [openai_error(error), b"[DONE]"]

    def body(self) -> bytes:
        choices = [
            Choice(
                index=i,
                message=ResponseMessage(content=self.choices.text(i)),
                finish_reason=_finish_reason(reason),
            )
            for i, reason in enumerate(self.choices.finish_reasons)
        ]
        usage = self.choices.usage or Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        return encode(ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
        ))


def _finish_reason(reason: str | None) -> str | None:
    # the engine's "abort" never reaches a client that is still there; anything else maps to OpenAI's words
    return reason if reason in (None, "stop", "length") else "stop"

