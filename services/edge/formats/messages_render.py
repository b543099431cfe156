"""Anthropic's Messages API, the answer: the message and its content blocks, the renderer of its named stream
events (services.edge.formats.messages has the request and the job it becomes), count_tokens' answer, and
Anthropic's error shape."""

from __future__ import annotations

from typing import Any

import msgspec

from services.edge.formats.base import Choices, Named, Out, Payload, PromptCount, Unstored
from services.edge.formats.messages import MessagesRequest
from shared.protocol import bus
from shared.protocol.errors import TokenbusError


class Usage(Out, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class TextOut(Out, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingOut(Out, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseOut(Out, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


Block = TextOut | ThinkingOut | ToolUseOut


class Message(Out, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    content: list[Block]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokens(Out):
    input_tokens: int


class ErrorDetail(Out):
    type: str
    message: str


class ErrorBody(Out, kw_only=True):
    type: str = "error"
    error: ErrorDetail


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
"""Anthropic's error types by HTTP status."""


def error_body(error: TokenbusError) -> ErrorBody:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return ErrorBody(error=ErrorDetail(type=kind, message=error.message))


def stop_reason(finish: str | None, stopped_by: str | int | None, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished answer: its budget ran out (max_tokens), it made
    calls (tool_use), a stop sequence ended it, or the model ended its turn."""
    if finish is None:
        return None, None
    if finish == "length":
        return "max_tokens", None
    if called or finish == "tool_calls":
        return "tool_use", None
    if isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return "end_turn", None


def _input(arguments: str) -> Any:
    """A call's arguments as the object Anthropic's `input` is (the raw text under `arguments` if the model wrote
    something else)."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class MessagesRenderer(Unstored):
    """The Messages stream as a state machine: message_start, then content blocks as the model makes them (each
    started, its deltas, stopped: thinking, text, tool_use), message_delta with the stop reason and usage,
    message_stop. The non-streamed answer is the same message whole."""

    def __init__(self, req: MessagesRequest, *, message_id: str, input_estimate: int) -> None:
        self.id = message_id
        self.model = req.model
        self.input_estimate = input_estimate
        """What message_start reports before the engine counted the prompt (message_delta gives the count)."""
        self.choices = Choices(1)
        self.started = False
        self.block = -1
        """The open block's index (-1: none yet)."""
        self.open: str | None = None
        """The open block's type (None: none open)."""
        self.calls = 0
        """Tool calls begun."""
        self.stopped_by: str | int | None = None

    def _event(self, name: str, **fields: Any) -> Named:
        return Named(name, {"type": name, **fields})

    def _start(self) -> list[Payload]:
        if self.started:
            return []
        self.started = True
        message = Message(id=self.id, content=[], model=self.model, stop_reason=None, stop_sequence=None,
                          usage=Usage(input_tokens=self.input_estimate, output_tokens=0))
        return [self._event("message_start", message=message), self._event("ping")]

    def _switch(self, kind: str, block: Block) -> list[Payload]:
        """Closes the open block and opens one of `kind`, unless one of that kind is open (a call always opens one
        of its own)."""
        if self.open == kind and kind != "tool_use":
            return []
        out = self._close()
        self.block += 1
        self.open = kind
        return [*out, self._event("content_block_start", index=self.block, content_block=block)]

    def _close(self) -> list[Payload]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.block)]

    def _delta(self, delta: dict[str, str]) -> Named:
        return self._event("content_block_delta", index=self.block, delta=delta)

    def render(self, event: bus.Output) -> list[Payload]:
        out = self._start()
        if isinstance(event, bus.Final):
            self.choices.final = event
            reason, sequence = self._stop()
            usage = {"input_tokens": event.prompt_tokens, "output_tokens": event.completion_tokens}
            return [*out, *self._close(), self._event("message_delta", delta={
                "stop_reason": reason, "stop_sequence": sequence}, usage=usage)]
        if not isinstance(event, bus.Tokens):
            return out
        self.choices.add(event)
        if event.stop_reason is not None:
            self.stopped_by = event.stop_reason
        if event.reasoning:
            out += self._switch("thinking", ThinkingOut(thinking=""))
            out.append(self._delta({"type": "thinking_delta", "thinking": event.reasoning}))
        if event.text:
            out += self._switch("text", TextOut(text=""))
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        for call in event.tool_calls:
            if call.id:
                self.calls += 1
                out += self._switch("tool_use", ToolUseOut(id=call.id, name=call.name, input={}))
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    def _stop(self) -> tuple[str | None, str | None]:
        return stop_reason(self.choices.finish_reasons[0], self.stopped_by, bool(self.choices.calls[0]))

    def done(self) -> list[Payload]:
        return [self._event("message_stop")]

    def error(self, error: TokenbusError) -> list[Payload]:
        return [Named("error", error_body(error))]

    def body(self) -> Message:
        content: list[Block] = []
        if reasoning := self.choices.reasoning(0):
            content.append(ThinkingOut(thinking=reasoning))
        calls = self.choices.calls[0]
        if (text := self.choices.text(0)) or not calls:
            content.append(TextOut(text=text))
        content += [ToolUseOut(id=call.id, name=call.name, input=_input(call.arguments)) for call in calls]
        final = self.choices.final or bus.Final(job=self.id, prompt_tokens=0, completion_tokens=0)
        reason, sequence = self._stop()
        return Message(id=self.id, content=content, model=self.model, stop_reason=reason, stop_sequence=sequence,
                       usage=Usage(input_tokens=final.prompt_tokens, output_tokens=final.completion_tokens))


def count_renderer() -> PromptCount:
    """count_tokens' answer: the prompt's tokens, as the worker counted them."""
    return PromptCount(lambda counted: CountTokens(input_tokens=counted), error_body)
