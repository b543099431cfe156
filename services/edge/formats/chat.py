"""OpenAI Chat Completions: the request structs, the job they become, and the chunk renderer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, UnsetType

from services.edge.formats import structured
from services.edge.formats.base import (
    TEXT_MARK,
    Choices,
    OpenAIStreamEnd,
    Out,
    Request,
    TextTemplate,
    Usage,
    encode,
    finish_reason,
    refuse,
    refuse_beyond_context,
    usage_of,
)
from services.edge.formats.common import (
    PositiveInt,
    Sampling,
    TemplateKwargs,
    TokenLogprobOut,
    sampling_params,
    template_kwargs,
    token_logprobs_out,
)
from services.edge.sse import data_frame
from shared import bus
from shared.errors import InvalidRequest

# request


class ContentPart(Request):
    type: str
    text: str | None = None


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(Sampling, kw_only=True):
    model: str
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Accepted for every model; a model that does not reason has nothing to spend it on."""
    response_format: structured.ResponseFormat | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    """vLLM's extension: variables for the model's chat template (reasoning_effort reaches it too)."""
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None


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
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs` set to true.", param="top_logprobs")
    if req.tools or req.functions:
        raise refuse("tools" if req.tools else "functions", "tool calling is not served yet")
    for name in ("function_call", "audio", "prediction", "web_search_options"):
        if getattr(req, name) is not None:
            raise refuse(name, "it is not served by this text model")
    if req.modalities and set(req.modalities) != {"text"}:
        raise refuse("modalities", "only text output is served")


def check_context(req: ChatCompletionRequest, max_model_len: int) -> None:
    """The budget the job runs with (max_completion_tokens wins) must leave room for the prompt."""
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    refuse_beyond_context(getattr(req, param), max_model_len, param)


def to_job(req: ChatCompletionRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    """Validates what the schema cannot express and builds the internal job."""
    _refuse_unsupported(req)
    messages = [
        bus.Message(role="system" if m.role == "developer" else m.role, content=_text_of(m, i))
        for i, m in enumerate(req.messages)
    ]
    params = sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    params.constraint = structured.of_response_format(req.response_format)
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat",
        messages=messages, params=params, created_ms=bus.now_ms(),
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, reasoning_effort=req.reasoning_effort),
    )


# response


class ChoiceLogprobs(Out):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class Delta(Out, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET


class ChunkChoice(Out, kw_only=True):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Out, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | UnsetType | None = UNSET


class ResponseMessage(Out, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None


class Choice(Out, kw_only=True):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(Out, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ChatRenderer(OpenAIStreamEnd):
    """Chat Completions as a state machine: per choice a role chunk, content chunks, a finish chunk;
    then the usage chunk when asked for."""

    def __init__(self, req: ChatCompletionRequest, *, response_id: str, created: int) -> None:
        self.id = response_id
        self.created = created
        self.model = req.model
        self.include_usage = req.include_usage
        self.with_logprobs = bool(req.logprobs)
        self.choices = Choices(req.n)
        self.started = [False] * req.n
        self.content: list[TextTemplate | None] = [None] * req.n
        """Per choice, the frame of a plain content token (no logprobs, not the last)."""

    def _chunk(self, choices: list[ChunkChoice], usage: Usage | UnsetType | None = UNSET) -> bytes:
        if usage is UNSET and self.include_usage:
            usage = None
        return data_frame(encode(ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
        )))

    def frames(self, event: bus.Output) -> list[bytes]:
        if isinstance(event, bus.Final):
            self.choices.final = event
            return [self._chunk([], usage_of(event, details=True))] if self.include_usage else []
        if not isinstance(event, bus.Tokens):
            return []
        self.choices.add(event)
        out: list[bytes] = []
        i = event.choice
        if not self.started[i]:
            self.started[i] = True
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))]))
        if event.text and event.finish_reason is None and not self.with_logprobs:  # most tokens
            out.append(self._content_template(i).fill(event.text))
        elif event.text or event.logprobs:
            logprobs = ChoiceLogprobs(content=token_logprobs_out(event.logprobs or [])) \
                if self.with_logprobs else None
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(content=event.text), logprobs=logprobs)]))
        if event.finish_reason is not None:
            reason = finish_reason(event.finish_reason)
            out.append(self._chunk([ChunkChoice(index=i, delta=Delta(), finish_reason=reason)]))
        return out

    def _content_template(self, i: int) -> TextTemplate:
        template = self.content[i]
        if template is None:
            template = self.content[i] = TextTemplate(
                self._chunk([ChunkChoice(index=i, delta=Delta(content=TEXT_MARK))]))
        return template

    def body(self) -> bytes:
        choices = [
            Choice(
                index=i,
                message=ResponseMessage(content=self.choices.text(i)),
                logprobs=ChoiceLogprobs(content=token_logprobs_out(self.choices.logprobs[i]))
                if self.with_logprobs else None,
                finish_reason=finish_reason(reason),
            )
            for i, reason in enumerate(self.choices.finish_reasons)
        ]
        final = self.choices.final or bus.Final(job=self.id, prompt_tokens=0, completion_tokens=0)
        return encode(ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=usage_of(final, details=True),
        ))
