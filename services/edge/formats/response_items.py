"""The output items of a response as the model writes them: its reasoning, messages (its text) and function
calls, in the order they come, each with the stream events that open it, fill it and close it.

A reasoning item opens at the first reasoning text: its raw text is its one `reasoning_text` content part, as
OpenAI's and vLLM's are (`summary` stays empty: no summary is made), or on OVMS's /v3 its one summary part, as OVMS
sends it. A message opens at
the first text after the start, the reasoning or a call; a call opens with its first delta (id and name). An
item closes when the next one opens or the response ends: one closed along the way is completed, the last one
takes the response's status. A response without any item still gets one (empty) message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET, UnsetType

from services.edge.formats.base import Out
from services.edge.formats.common import TokenLogprobOut, token_logprobs_out
from shared.protocol import bus

Event = tuple[str, dict[str, Any]]
"""A stream event's type and fields (the renderer numbers it)."""


class OutputText(Out, kw_only=True):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[TokenLogprobOut] = []


class OutputMessage(Out, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: str = "assistant"
    status: str
    content: list[OutputText]


class FunctionCallItem(Out, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class SummaryText(Out, kw_only=True):
    type: str = "summary_text"
    text: str


class ReasoningText(Out, kw_only=True):
    type: str = "reasoning_text"
    text: str


class ReasoningItem(Out, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[SummaryText]
    content: list[ReasoningText] | UnsetType = UNSET
    status: str


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


@dataclass
class _Item:
    id: str
    index: int
    call: bus.ToolCall | None = None
    """A function call; None for a message or reasoning."""
    reasoning: bool = False
    summarized: bool = False
    """A reasoning item whose text is its summary (OVMS's form), not its content."""
    texts: list[str] = field(default_factory=list)
    """A message's text, or the reasoning."""
    logprobs: list[bus.TokenLogprob] = field(default_factory=list)
    status: str = "in_progress"

    @property
    def message(self) -> bool:
        return self.call is None and not self.reasoning

    def part(self) -> OutputText:
        return OutputText(text="".join(self.texts), logprobs=token_logprobs_out(self.logprobs))

    def summary(self) -> SummaryText:
        return SummaryText(text="".join(self.texts))

    def thought(self) -> ReasoningText:
        return ReasoningText(text="".join(self.texts))

    def out(self) -> OutputItem:
        if self.reasoning:
            done = self.status != "in_progress"
            if self.summarized:
                return ReasoningItem(id=self.id, status=self.status, summary=[self.summary()] if done else [])
            return ReasoningItem(id=self.id, status=self.status, summary=[], content=[self.thought()] if done else [])
        if self.call is None:
            content = [self.part()] if self.status != "in_progress" else []
            return OutputMessage(id=self.id, status=self.status, content=content)
        return FunctionCallItem(id=self.id, call_id=self.call.id, name=self.call.name,
                                arguments=self.call.arguments if self.status != "in_progress" else "",
                                status=self.status)

    def ids(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index}


class OutputItems:
    """The items of one response; `eager`: every token belongs to one message, opened at the first event with
    text or logprobs (a request without tools)."""

    def __init__(self, message_id: str, eager: bool, summarized: bool = False) -> None:
        self.message_id = message_id
        self.eager = eager
        self.summarized = summarized
        """Reasoning as OVMS sends it: its text is the item's summary (else its reasoning_text content)."""
        self.items: list[_Item] = []
        self.open: _Item | None = None

    def tokens(self, event: bus.Tokens) -> list[Event]:
        out: list[Event] = []
        if event.reasoning:
            out += self._reasoning(event.reasoning)
        if event.text or (self.eager and self.open is None and event.logprobs):
            out += self._message()  # an empty event waits: its model may be deciding whether it reasons
        message = self.open if self.open is not None and self.open.message else None
        if message is not None:
            message.texts.append(event.text)
            message.logprobs.extend(event.logprobs or [])
            if event.text:
                out.append(("response.output_text.delta", {
                    "delta": event.text, "logprobs": token_logprobs_out(event.logprobs or []), **message.ids(),
                    "content_index": 0}))
        for delta in event.tool_calls:
            out += self._call_delta(delta)
        return out

    def finish(self, status: str) -> list[Event]:
        """Closes the last item with the response's status (opening an empty message if there is none)."""
        out = [] if self.items else self._message()
        return out + self._close(status)

    def cut(self) -> list[Event]:
        """Closes the item still open, if any, as incomplete: the response failed, or was cancelled, inside it."""
        return self._close("incomplete")

    def output(self) -> list[OutputItem]:
        return [item.out() for item in self.items]

    def text(self) -> str:
        return "".join(text for item in self.items if item.message for text in item.texts)

    def answer(self) -> bus.Message:
        """The response's output as one assistant turn of the conversation."""
        return bus.Message(role="assistant", content=self.text(),
                           tool_calls=[item.call for item in self.items if item.call is not None],
                           reasoning="".join(text for item in self.items if item.reasoning for text in item.texts))

    def _add(self, item: _Item) -> list[Event]:
        out = self._close("completed")
        self.items.append(item)
        self.open = item
        return [*out, ("response.output_item.added", {"output_index": item.index, "item": item.out()})]

    def _reasoning(self, text: str) -> list[Event]:
        out: list[Event] = []
        item = self.open
        if item is None or not item.reasoning:
            count = sum(1 for item in self.items if item.reasoning)
            item_id = "rs_" + self.message_id.removeprefix("msg_") + (f"_{count}" if count else "")
            item = _Item(id=item_id, index=len(self.items), reasoning=True, summarized=self.summarized)
            if item.summarized:
                out += [*self._add(item), ("response.reasoning_summary_part.added", {
                    **item.ids(), "summary_index": 0, "part": SummaryText(text="")})]
            else:
                out += [*self._add(item), ("response.content_part.added", {
                    **item.ids(), "content_index": 0, "part": ReasoningText(text="")})]
        item.texts.append(text)
        if item.summarized:
            return [*out, ("response.reasoning_summary_text.delta", {**item.ids(), "summary_index": 0,
                                                                     "delta": text})]
        return [*out, ("response.reasoning_text.delta", {**item.ids(), "content_index": 0, "delta": text})]

    def _message(self) -> list[Event]:
        if self.open is not None and self.open.message:
            return []
        count = sum(1 for item in self.items if item.message)
        item_id = self.message_id if count == 0 else f"{self.message_id}_{count}"
        item = _Item(id=item_id, index=len(self.items))
        return [*self._add(item), ("response.content_part.added", {
            **item.ids(), "content_index": 0, "part": OutputText(text="")})]

    def _call_delta(self, delta: bus.ToolCallDelta) -> list[Event]:
        out: list[Event] = []
        if delta.id:
            call = bus.ToolCall(id=delta.id, name=delta.name, arguments="")
            count = sum(1 for item in self.items if item.call is not None)
            item_id = "fc_" + self.message_id.removeprefix("msg_") + (f"_{count}" if count else "")
            out += self._add(_Item(id=item_id, index=len(self.items), call=call))
        item = self.open
        if delta.arguments and item is not None and item.call is not None:
            item.call.arguments += delta.arguments
            out.append(("response.function_call_arguments.delta", {**item.ids(), "delta": delta.arguments}))
        return out

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        if item.reasoning and item.summarized:
            summary = item.summary()
            closing: list[Event] = [
                ("response.reasoning_summary_text.done", {**item.ids(), "summary_index": 0, "text": summary.text}),
                ("response.reasoning_summary_part.done", {**item.ids(), "summary_index": 0, "part": summary})]
        elif item.reasoning:
            thought = item.thought()
            closing = [
                ("response.reasoning_text.done", {**item.ids(), "content_index": 0, "text": thought.text}),
                ("response.content_part.done", {**item.ids(), "content_index": 0, "part": thought})]
        elif item.call is None:
            part = item.part()
            closing = [
                ("response.output_text.done", {**item.ids(), "content_index": 0, "text": part.text,
                                               "logprobs": part.logprobs}),
                ("response.content_part.done", {**item.ids(), "content_index": 0, "part": part})]
        else:
            closing = [("response.function_call_arguments.done", {**item.ids(), "name": item.call.name,
                                                                  "arguments": item.call.arguments})]
        return [*closing, ("response.output_item.done", {"output_index": item.index, "item": item.out()})]
