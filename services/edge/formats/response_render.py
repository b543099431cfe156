"""The OpenAI Responses API's answer: the response object at every point of its life, and the typed stream events
that carry it (created, in progress, the output items, then completed / incomplete / failed)."""

from __future__ import annotations

import time
from typing import Any

from msgspec import UNSET, UnsetType

from services.edge.formats import calling, item_refs
from services.edge.formats.base import END, Named, Out, Payload, PromptCount, encode, openai_error_body
from services.edge.formats.response_items import Event, OutputItem, OutputItems
from services.edge.formats.responses import ResponsesRequest, TextFormat
from services.edge.store import Conversation, Turn
from shared.protocol import bus
from shared.protocol.errors import StreamAbandoned, TokenbusError


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


class FunctionToolOut(Out, kw_only=True):
    type: str = "function"
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class NamedChoiceOut(Out):
    type: str
    name: str


def echo_tools(tools: list[calling.ResponsesTool] | None) -> list[FunctionToolOut]:
    """The response's `tools`: each function in OpenAI's flat form, however it was given."""
    return [FunctionToolOut(name=f.name, description=f.description, parameters=f.parameters, strict=f.strict)
            for f, _param in calling.responses_functions(tools)]


def echo_tool_choice(choice: calling.ToolChoice | None) -> str | NamedChoiceOut:
    """The response's `tool_choice`: as sent; a function in OpenAI's flat form."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    return NamedChoiceOut(type=choice.type, name=choice.function.name if choice.function else choice.name or "")


class ConversationRef(Out):
    id: str


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
    output: list[OutputItem]
    output_text: str
    parallel_tool_calls: bool = True
    previous_response_id: str | None
    reasoning: Reasoning
    store: bool
    temperature: float
    text: TextOut
    tool_choice: str | NamedChoiceOut = "auto"
    tools: list[FunctionToolOut] = []
    top_logprobs: int = 0
    top_p: float
    truncation: str
    usage: ResponseUsage | UnsetType = UNSET
    """Absent until the response is done (the schema does not allow null here)."""
    user: str | UnsetType = UNSET
    metadata: dict[str, str]
    background: bool = False
    conversation: ConversationRef | None = None
    service_tier: str = "default"


class InputTokens(Out, kw_only=True):
    """POST /v1/responses/input_tokens' answer."""

    object: str = "response.input_tokens"
    input_tokens: int


def input_tokens_renderer() -> PromptCount:
    return PromptCount(lambda counted: InputTokens(input_tokens=counted), openai_error_body)


class Deleted(Out):
    id: str
    object: str = "response"
    deleted: bool = True


_ERROR_CODES = {"InvalidRequest": "invalid_prompt", "ContextLengthExceeded": "invalid_prompt"}


class ResponsesRenderer:
    """The Responses stream as a state machine: created and in_progress, then the output items as they come
    (messages with their text deltas, function calls with their argument deltas; see response_items), then
    completed / incomplete / failed."""

    def __init__(
        self, req: ResponsesRequest, *, response_id: str, created_at: int,
        conversation: Conversation | None = None, added: list[bus.Message] | None = None, ovms: bool = False,
        conversation_id: str = "", new_items: list[bytes] | None = None,
    ) -> None:
        self.req = req
        self.id = response_id
        self.created_at = created_at
        self.conversation = conversation or Conversation()
        """What this turn continues."""
        self.added = added or []
        """This turn's input, as messages."""
        self.conversation_id = conversation_id
        """The Conversations-API conversation the turn runs in ("": none)."""
        self.new_items = new_items or []
        """This turn's input items as a conversation keeps them (its output's follow at the end) and the stored
        response lists them."""
        self.ovms = ovms
        """Served on OVMS's /v3 path: its stream ends with `data: [DONE]` and a cut response's reason is
        `max_tokens`, as its page documents."""
        self.sequence = 0
        self.items = OutputItems(item_refs.item_id("msg", response_id),
                                 eager=not req.tools or req.tool_choice == "none", summarized=ovms)
        self.final: bus.Final | None = None
        self.cut = False
        """The answer ended at its token budget."""
        self.status = "queued" if req.background else "in_progress"
        """queued (a background response nobody has started), in_progress, then completed, incomplete, failed or
        cancelled (a background response cancelled)."""
        self.completed_at: int | None = None
        self.error_detail: ResponseError | None = None
        self.started = False

    # the response object at any point of its life

    def response(self) -> Response:
        req, final = self.req, self.final
        usage = UNSET if final is None else ResponseUsage(
            input_tokens=final.prompt_tokens, input_tokens_details=InputTokensDetails(),
            output_tokens=final.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=final.reasoning_tokens),
            total_tokens=final.prompt_tokens + final.completion_tokens,
        )
        done = self.status in ("completed", "incomplete", "cancelled")  # a cancelled one's: what it had written
        return Response(
            id=self.id, created_at=self.created_at, completed_at=self.completed_at, status=self.status,
            error=self.error_detail,
            incomplete_details=IncompleteDetails(reason="max_tokens" if self.ovms else "max_output_tokens")
            if self.status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, model=req.model,
            output=self.items.output() if done else [], output_text=self.items.text() if done else "",
            previous_response_id=req.previous_response_id,
            tool_choice=echo_tool_choice(req.tool_choice), tools=echo_tools(req.tools),
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            reasoning=Reasoning(effort=req.reasoning.effort if req.reasoning else None),
            store=req.store, temperature=1.0 if req.temperature is None else req.temperature,
            text=TextOut(format=echo_format(req.text.format if req.text else None)), top_logprobs=req.top_logprobs or 0,
            top_p=1.0 if req.top_p is None else req.top_p, truncation=req.truncation or "disabled",
            usage=usage, user=UNSET if req.user is None else req.user, metadata=req.metadata or {},
            background=bool(req.background),
            conversation=ConversationRef(id=self.conversation_id) if self.conversation_id else None,
        )

    # stream events

    def _event(self, kind: str, **fields: Any) -> Named:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return Named(kind, payload)

    def _events(self, events: list[Event]) -> list[Payload]:
        return [self._event(kind, **fields) for kind, fields in events]

    def _opening(self) -> list[Payload]:
        """response.created, then (a background response, queued until a worker takes it, as OpenAI's stream
        says) response.queued, then response.in_progress."""
        self.started = True
        created = [self._event("response.created", response=self.response())]
        if self.status == "queued":
            created.append(self._event("response.queued", response=self.response()))
        self.status = "in_progress"
        return [*created, self._event("response.in_progress", response=self.response())]

    def render(self, event: bus.Output) -> list[Payload]:
        if not isinstance(event, bus.Tokens | bus.Final):
            return []
        out = [] if self.started else self._opening()
        if isinstance(event, bus.Tokens):
            self.cut = self.cut or event.finish_reason == "length"
            return out + self._events(self.items.tokens(event))
        self.final = event
        self.status = "incomplete" if self.cut else "completed"
        self.completed_at = int(time.time()) if self.status == "completed" else None  # OpenAI: only then
        closing = self._events(self.items.finish(self.status))
        return [*out, *closing, self._event(f"response.{self.status}", response=self.response())]

    def to_store(self) -> Turn | None:
        """The finished response, when the request asks to store it: its caller stores it before the client hears
        of it, so any edge can serve it at once; its history as it was run (what truncation left of it)."""
        if not self.req.store and not self.conversation_id:
            return None
        dropped = self.final.dropped_messages if self.final is not None else 0
        # a conversation takes the turns that answered, not those that failed or were cancelled
        answered = self.status in ("completed", "incomplete")
        outputs = [encode(item) for item in self.items.output()] if answered else []
        return Turn(self.id, encode(self.response()), self.conversation, [*self.added, self.items.answer()],
                    dropped, stored=self.req.store, conversation_id=self.conversation_id if answered else "",
                    items=(*self.new_items, *outputs), inputs=tuple(self.new_items))

    def done(self) -> list[Payload]:
        return [END] if self.ovms else []

    def error(self, error: TokenbusError) -> list[Payload]:
        """The item left open closed as incomplete, an `error` event (its type, code, message and param, as
        OpenAI's stream sends them), then the response, failed (or cancelled: a background response its client
        cancelled)."""
        out = self._events(self.items.cut()) if self.started else self._opening()
        if error.param == "messages":  # the worker names a chat prompt's field; a response's is its input
            error.param = "input"
        if self.req.background and isinstance(error, StreamAbandoned):
            self.status = "cancelled"  # OpenAI's stream has no event of its own for it: the closing one says so
            return [*out, self._event("response.failed", response=self.response()), *self.done()]
        self.status = "failed"
        code = _ERROR_CODES.get(type(error).__name__, "server_error")
        self.error_detail = ResponseError(code=code, message=error.message)
        return [*out, self._event("error", code=error.code or code, message=error.message, param=error.param),
                self._event("response.failed", response=self.response()), *self.done()]

    @property
    def ended(self) -> bool:
        return self.status not in ("queued", "in_progress")

    def body(self) -> Response:
        return self.response()

