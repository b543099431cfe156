"""The OpenAI Responses API: requests, the conversation they continue, and the typed stream events."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, UnsetType

from services.edge.formats import structured
from services.edge.formats.base import Choices, Out, Request, encode, refuse, refuse_beyond_context
from services.edge.formats.common import PositiveInt, Sampling, TemplateKwargs, sampling_params, template_kwargs
from services.edge.sse import DONE, event_frame
from services.edge.store import ResponseStore
from shared import bus
from shared.errors import InvalidRequest, TokenbusError

# request


class InputContent(Request):
    type: str
    text: str | None = None


class InputItem(Request):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]
    type: str = "message"


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: structured.SchemaName | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextParam(Request):
    format: TextFormat | None = None


class ReasoningParam(Request):
    effort: str | None = None
    summary: str | None = None


MetadataValue = Annotated[str, Meta(max_length=512)]
Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)], MetadataValue], Meta(max_length=16)]


class ResponsesRequest(Sampling, kw_only=True):
    """OpenAI's fields, and the sampling extras OVMS documents for /v3/responses (top_k, seed, stop, the
    penalties, ignore_eos, logprobs, response_format, chat_template_kwargs): each served or refused."""

    model: str
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[InputItem], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    logprobs: bool | None = None
    include_stop_str_in_output: bool | None = None
    response_format: structured.ResponseFormat | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    best_of: int | None = None
    length_penalty: float | None = None
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    max_ngram_size: int | None = None
    text: TextParam | None = None
    metadata: Metadata | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningParam | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    service_tier: str | None = None
    prompt: Any = None


def _refuse_decoding_extras(req: ResponsesRequest) -> None:
    """OVMS's beam-search and speculative-decoding fields: named, never ignored."""
    if req.n != 1:
        raise refuse("n", "a response has one output")
    if req.best_of not in (None, 1) or req.length_penalty not in (None, 1.0):
        raise refuse("best_of" if req.best_of not in (None, 1) else "length_penalty", "beam search is not served")
    for name in ("num_assistant_tokens", "assistant_confidence_threshold", "max_ngram_size"):
        if getattr(req, name) is not None:
            raise refuse(name, "speculative and prompt-lookup decoding are not served")


def refuse_unsupported(req: ResponsesRequest) -> None:
    """The 400s for what we do not serve, each naming its parameter."""
    if req.background:
        raise refuse("background", "responses run in the foreground; stream them instead")
    if req.conversation is not None:
        raise refuse("conversation", "use previous_response_id to continue a conversation")
    if req.service_tier not in (None, "auto", "default"):
        raise refuse("service_tier", "there is one service tier")
    if req.prompt is not None:
        raise refuse("prompt", "prompt templates are not served")
    _refuse_decoding_extras(req)
    if req.response_format is not None and req.text and req.text.format and req.text.format.type != "text":
        raise InvalidRequest("Give the format once: `text.format` or `response_format`, not both.",
                             param="response_format")
    for i, tool in enumerate(req.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            raise refuse(f"tools[{i}]", "function tools are not served yet")
        raise refuse(f"tools[{i}]", f"the built-in tool {kind!r} is not served")
    if req.text and req.text.format and req.text.format.type == "json_schema" and not req.text.format.name:
        raise InvalidRequest("`text.format.name` is required with type json_schema.", param="text.format.name")


def check_context(req: ResponsesRequest, max_model_len: int) -> None:
    """max_output_tokens must leave room for the input (truncation drops turns, never the budget)."""
    refuse_beyond_context(req.max_output_tokens, max_model_len, "max_output_tokens")


def _content_text(content: str | list[InputContent], index: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise InvalidRequest(f"Content of type {part.type!r} is not supported by this text model.",
                                 param=f"input[{index}].content[{j}].type")
        texts.append(part.text)
    return "".join(texts)


def input_messages(req: ResponsesRequest) -> list[bus.Message]:
    if isinstance(req.input, str):
        return [bus.Message(role="user", content=req.input)]
    messages = []
    for i, item in enumerate(req.input):
        if item.type != "message":
            raise refuse(f"input[{i}].type", f"input items of type {item.type!r} are not served yet")
        role = "system" if item.role == "developer" else item.role
        messages.append(bus.Message(role=role, content=_content_text(item.content, i)))
    return messages


def to_job(
    req: ResponsesRequest, history: list[bus.Message], *, job_id: str, reply_to: str, deadline_ms: int
) -> bus.Job:
    """The job for this turn: instructions first, then the earlier turns, then the new input."""
    instructions = [bus.Message(role="system", content=req.instructions)] if req.instructions else []
    logprobs = req.top_logprobs if req.top_logprobs is not None else (0 if req.logprobs else None)
    params = sampling_params(req, max_tokens=req.max_output_tokens, logprobs=logprobs)
    params.include_stop_str_in_output = bool(req.include_stop_str_in_output)
    if req.text and req.text.format and req.text.format.type != "text":
        params.constraint = structured.of_text_format(req.text.format.type, req.text.format.schema)
    else:
        params.constraint = structured.of_response_format(req.response_format)
    effort = req.reasoning.effort if req.reasoning else None
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="chat",
        messages=instructions + history, params=params, truncate=req.truncation == "auto",
        created_ms=bus.now_ms(),
        # as OVMS does: any reasoning effort turns the template's thinking on
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs, enable_thinking=True if effort else None,
                                             reasoning_effort=effort),
    )


# response


class TopLogprob(Out):
    token: str
    logprob: float


class LogProb(Out):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class OutputText(Out, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[LogProb] = []


class OutputMessage(Out, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    status: str
    content: list[OutputText]


class IncompleteDetails(Out):
    reason: str


class ResponseError(Out):
    code: str
    message: str


class InputTokensDetails(Out):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Out):
    reasoning_tokens: int = 0


class ResponseUsage(Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Reasoning(Out):
    effort: str | None = None
    summary: str | None = None


class TextFormatOut(Out):
    type: str = "text"
    name: str | UnsetType = UNSET
    schema: dict[str, Any] | UnsetType = UNSET
    description: str | UnsetType | None = UNSET
    strict: bool | UnsetType | None = UNSET


def echo_format(fmt: TextFormat | None) -> TextFormatOut:
    """The response's `text.format`: the request's, as OpenAI echoes it."""
    if fmt is None or fmt.type != "json_schema":
        return TextFormatOut(type=fmt.type if fmt else "text")
    return TextFormatOut(type=fmt.type, name=fmt.name or "", schema=fmt.schema or {}, description=fmt.description,
                         strict=fmt.strict)


class TextOut(Out):
    format: TextFormatOut


class Response(Out, kw_only=True):
    id: str
    object: str = "response"
    created_at: int
    completed_at: int | None = None
    status: str
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    output_text: str
    parallel_tool_calls: bool = True
    previous_response_id: str | None
    reasoning: Reasoning
    store: bool
    temperature: float
    text: TextOut
    tool_choice: Any = "auto"
    tools: list[Any] = []
    top_logprobs: int | None
    top_p: float
    truncation: str
    usage: ResponseUsage | UnsetType = UNSET
    """Absent until the response is done (the schema does not allow null here)."""
    user: str | UnsetType = UNSET
    metadata: dict[str, str]


class Deleted(Out):
    id: str
    object: str = "response"
    deleted: bool = True


def _logprobs(logprobs: list[bus.TokenLogprob]) -> list[LogProb]:
    return [LogProb(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
                    top_logprobs=[TopLogprob(token=t.token, logprob=t.logprob) for t in lp.top])
            for lp in logprobs]


_ERROR_CODES = {"InvalidRequest": "invalid_prompt", "ContextLengthExceeded": "invalid_prompt"}


class ResponsesRenderer:
    """The Responses stream as a state machine: created, in_progress, the message item and its text
    part opened, text deltas, everything closed, then completed / incomplete / failed."""

    def __init__(
        self, req: ResponsesRequest, *, response_id: str, created_at: int, history: list[bus.Message],
        store: ResponseStore | None, tenant: str = "", ovms: bool = False,
    ) -> None:
        self.req = req
        self.id = response_id
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.created_at = created_at
        self.history = history
        self.store = store
        self.tenant = tenant
        self.ovms = ovms
        """Served on OVMS's /v3 path: its stream ends with `data: [DONE]` and a cut response's reason is
        `max_tokens`, as its page documents."""
        self.sequence = 0
        self.choices = Choices(1)
        self.status = "in_progress"
        self.completed_at: int | None = None
        self.error_detail: ResponseError | None = None
        self.started = False

    # the response object at any point of its life

    def _text_part(self) -> OutputText:
        return OutputText(text=self.choices.text(0), logprobs=_logprobs(self.choices.logprobs[0]))

    def _item(self) -> OutputMessage:
        status = self.status if self.status in ("completed", "incomplete") else "in_progress"
        content = [self._text_part()] if self.status != "in_progress" else []
        return OutputMessage(id=self.message_id, status=status, content=content)

    def response(self) -> Response:
        req, final = self.req, self.choices.final
        usage = UNSET if final is None else ResponseUsage(
            input_tokens=final.prompt_tokens, input_tokens_details=InputTokensDetails(),
            output_tokens=final.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=final.reasoning_tokens),
            total_tokens=final.prompt_tokens + final.completion_tokens,
        )
        done = self.status in ("completed", "incomplete")
        return Response(
            id=self.id, created_at=self.created_at, completed_at=self.completed_at, status=self.status,
            error=self.error_detail,
            incomplete_details=IncompleteDetails(reason="max_tokens" if self.ovms else "max_output_tokens")
            if self.status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=req.model,
            output=[self._item()] if done else [], output_text=self.choices.text(0) if done else "",
            previous_response_id=req.previous_response_id,
            tool_choice="auto" if req.tool_choice is None else req.tool_choice, tools=req.tools or [],
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            reasoning=Reasoning(effort=req.reasoning.effort if req.reasoning else None),
            store=req.store, temperature=1.0 if req.temperature is None else req.temperature,
            text=TextOut(format=echo_format(req.text.format if req.text else None)), top_logprobs=req.top_logprobs,
            top_p=1.0 if req.top_p is None else req.top_p, truncation=req.truncation or "disabled",
            usage=usage, user=UNSET if req.user is None else req.user, metadata=req.metadata or {},
        )

    # stream events

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event_frame(kind, encode(payload))

    def _ids(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _opening(self) -> list[bytes]:
        self.started = True
        empty_item = OutputMessage(id=self.message_id, status="in_progress", content=[])
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
            self._event("response.output_item.added", output_index=0, item=empty_item),
            self._event("response.content_part.added", part=OutputText(text=""), **self._ids()),
        ]

    def frames(self, event: bus.Output) -> list[bytes]:
        if not isinstance(event, bus.Tokens | bus.Final):
            return []
        out = [] if self.started else self._opening()
        if isinstance(event, bus.Tokens):
            self.choices.add(event)
            if event.text:
                out.append(self._event("response.output_text.delta", delta=event.text,
                                       logprobs=_logprobs(event.logprobs or []), **self._ids()))
            return out
        self.choices.final = event
        self.completed_at = int(time.time())
        self.status = "incomplete" if self.choices.finish_reasons[0] == "length" else "completed"
        part = self._text_part()
        return [
            *out,
            self._event("response.output_text.done", text=part.text, logprobs=part.logprobs, **self._ids()),
            self._event("response.content_part.done", part=part, **self._ids()),
            self._event("response.output_item.done", output_index=0, item=self._item()),
            self._event(f"response.{self.status}", response=self.response()),
        ]

    async def settle(self) -> None:
        """Stores the finished response before the client hears of it, so any edge can serve it at once."""
        if self.store is None or not self.req.store:
            return
        answer = bus.Message(role="assistant", content=self.choices.text(0))
        await self.store.save(self.id, encode(self.response()), [*self.history, answer], self.tenant)

    def done(self) -> list[bytes]:
        return [DONE] if self.ovms else []

    def error(self, error: TokenbusError) -> list[bytes]:
        """An `error` event (its type, code, message and param, as OpenAI's stream sends them), then the
        response, failed."""
        self.status = "failed"
        code = _ERROR_CODES.get(type(error).__name__, "server_error")
        self.error_detail = ResponseError(code=code, message=error.message)
        out = [] if self.started else self._opening()
        return [*out, self._event("error", code=error.code or code, message=error.message, param=error.param),
                self._event("response.failed", response=self.response()), *self.done()]

    def body(self) -> bytes:
        return encode(self.response())

