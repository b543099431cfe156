"""The OpenAI Conversations API's shapes: its requests, the conversation and item-list objects it answers with, and
input items as a conversation keeps them (each with an id and a status, a message's content as typed parts)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.edge.formats import calling, item_refs
from services.edge.formats.base import Out, Request
from services.edge.formats.responses import InputContent, InputItem, Metadata, messages_of
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

MAX_ADDED = 20
"""Items one create or add call may carry (OpenAI's bound)."""


class CreateConversationBody(Request):
    items: Annotated[list[InputItem], Meta(max_length=MAX_ADDED)] | None = None
    metadata: Metadata | None = None


class UpdateConversationBody(Request):
    metadata: Metadata


class AddItemsBody(Request):
    items: Annotated[list[InputItem], Meta(min_length=1, max_length=MAX_ADDED)]


class ConversationResource(Out):
    id: str
    created_at: int
    metadata: dict[str, str]
    object: str = "conversation"


class DeletedConversation(Out):
    id: str
    object: str = "conversation.deleted"
    deleted: bool = True


class ItemList(Out):
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


def _id(kind: str, home: str, index: int) -> str:
    """A new item id that names `home` (see item_refs): the response whose input it is (the same however often its
    request is planned), or the conversation the Conversations API adds it to."""
    if home.startswith(item_refs.CONVERSATION_PREFIX):
        return item_refs.conversation_item_id(kind, home)
    return item_refs.item_id(kind, home, f"i{index}") if home else f"{kind}_{uuid.uuid4().hex}"


def _parts(role: str, content: str | list[InputContent] | None) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    given = [InputContent(type=kind, text=content)] if isinstance(content, str) else content or []
    parts: list[dict[str, Any]] = []
    for part in given:
        parts.append({"type": part.type, "text": part.text or ""})
        if part.type == "output_text":
            parts[-1]["annotations"] = []
    return parts


def _texts(parts: list[InputContent] | None, kind: str) -> list[dict[str, Any]]:
    return [{"type": kind, "text": part.text or ""} for part in parts or []]


def kept(item: InputItem, home: str = "", index: int = 0) -> dict[str, Any]:
    """An input item as a conversation keeps it (and lists it): with an id (its own, or a new one: see _id) and
    a status."""
    if item.type == "function_call":
        return {"type": "function_call", "id": item.id or _id("fc", home, index), "call_id": item.call_id,
                "name": item.name, "arguments": calling.arguments_text(item.arguments or "", "arguments"),
                "status": "completed"}
    if item.type == "function_call_output":
        output = item.output
        text = calling.arguments_text(output, "output") if isinstance(output, dict) else (
            output if isinstance(output, str) else "".join(part.text or "" for part in output or []))
        return {"type": "function_call_output", "id": item.id or _id("fco", home, index), "call_id": item.call_id,
                "output": text, "status": "completed"}
    if item.type == "reasoning":
        return {"type": "reasoning", "id": item.id or _id("rs", home, index),
                "summary": _texts(item.summary, "summary_text"),
                "content": _texts(item.content if isinstance(item.content, list) else None, "reasoning_text")}
    role = item.role or "user"
    return {"type": "message", "id": item.id or _id("msg", home, index), "status": "completed", "role": role,
            "content": _parts(role, item.content)}


_decode_items = msgspec.json.Decoder(list[InputItem]).decode
decode_item = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.encode


def history(items: list[dict[str, Any]]) -> list[bus.Message]:
    """A conversation's items as the messages a turn continues."""
    return messages_of(_decode_items(_encode(items))) if items else []


def added(items: list[InputItem], before: list[dict[str, Any]], conversation_id: str,
          field: str = "items") -> list[bytes]:
    """Items to add after `before` (see check_added), as the conversation `conversation_id` keeps them."""
    check_added(items, before, field)
    return listed(items, home=conversation_id)


def check_added(items: list[InputItem], before: list[dict[str, Any]], field: str = "items") -> None:
    """Refuses items that cannot follow `before`, as a turn's input is checked (a call's output must answer a
    call made before it), naming the item under `field`."""
    try:
        messages_of(items, history(before))
    except InvalidRequest as exc:
        if exc.param and exc.param.startswith("input["):
            exc.param = field + exc.param.removeprefix("input")
        raise


def listed(items: list[InputItem], home: str = "") -> list[bytes]:
    """Items as a conversation keeps them and a stored response lists its input (each with an id; new ones name
    `home`, the response whose input they are or the conversation they are added to: see _id)."""
    return [_encode(kept(item, home, i)) for i, item in enumerate(items)]
