"""Item ids that name their response, and the Responses API's `item_reference` input items that use them.

Every item id this server makes for a stored response's items (its output's messages, reasoning and function
calls, and the input items it lists without an id of their own) is `<kind>_<hex>[_<suffix>]`, where `resp_<hex>`
is the response. So an item reference is found by reading that one response, with no index to keep beside it:
an item lives exactly as long as its response, and goes when it is deleted. An item added to a conversation by the
Conversations API (no response's) is `<kind>_conv<hex>_<random>`, where `conv_<hex>` is the conversation: found
by reading that conversation, as long as it keeps the item. An id a client gave its own input item names neither
and cannot be referenced (the client has the item already).
"""

from __future__ import annotations

import re
import uuid

import msgspec

from services.edge.formats.responses import InputItem
from shared.protocol.errors import InvalidRequest

RESPONSE_PREFIX = "resp_"
CONVERSATION_PREFIX = "conv_"
_OWNED = re.compile(r"(?:msg|rs|fc|fco)_([0-9a-f]{32})(?:_[0-9a-z]+)?")
_IN_CONVERSATION = re.compile(r"(?:msg|rs|fc|fco)_conv([0-9a-f]{32})_[0-9a-f]{12}")


def item_id(kind: str, response_id: str, suffix: str = "") -> str:
    """The id of an item of the response `response_id` (`kind`: msg, rs, fc or fco)."""
    return f"{kind}_{response_id.removeprefix(RESPONSE_PREFIX)}" + (f"_{suffix}" if suffix else "")


def conversation_item_id(kind: str, conversation_id: str) -> str:
    """A new id for an item added to the conversation `conversation_id` (`kind`: msg, rs, fc or fco)."""
    return f"{kind}_conv{conversation_id.removeprefix(CONVERSATION_PREFIX)}_{uuid.uuid4().hex[:12]}"


def home(item: str) -> str | None:
    """The response whose item `item` is (None: an id this server did not make for a response's item)."""
    found = _OWNED.fullmatch(item)
    return RESPONSE_PREFIX + found.group(1) if found else None


def conversation_of(item: str) -> str | None:
    """The conversation the Conversations API added item `item` to (None: not such an item)."""
    found = _IN_CONVERSATION.fullmatch(item)
    return CONVERSATION_PREFIX + found.group(1) if found else None


def references(items: list[InputItem], field: str = "input") -> list[str]:
    """The ids the `item_reference` items among `items` (the request's `field`) name, in order (each checked to
    name a stored item)."""
    out = []
    for i, item in enumerate(items):
        if not is_reference(item):
            continue
        if not item.id:
            raise InvalidRequest("An item_reference item needs the `id` of the item it references.",
                                 param=f"{field}[{i}].id")
        if home(item.id) is None and conversation_of(item.id) is None:
            raise _missing(item.id, i, field)
        out.append(item.id)
    return out


def homes(ids: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Each referenced item of a response: the response it is of (see references)."""
    return {item: found for item in ids if (found := home(item)) is not None}


def conversations(ids: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Each referenced item added to a conversation: the conversation (see references)."""
    return {item: found for item in ids if (found := conversation_of(item)) is not None}


def is_reference(item: InputItem) -> bool:
    """An `item_reference` item: so typed, or (OpenAI's type is optional there) an untyped item with only an id."""
    if item.type == "item_reference":
        return True
    untyped = item.type == "message" and item.role is None and item.content is None
    return untyped and item.id is not None


_to_item = msgspec.json.Decoder(InputItem)
"""A stored item as an input item: what an input item does not have (an output part's annotations) is ignored."""


def resolved(items: list[InputItem], found: dict[str, bytes], field: str = "input") -> list[InputItem]:
    """`items` with each reference replaced by the item it names, as stored (`found`: each stored item's JSON
    by id); one not found is a 400 naming it under `field`."""
    out = []
    for i, item in enumerate(items):
        if not is_reference(item):
            out.append(item)
            continue
        assert item.id is not None  # nosec B101: references() checked it (tokenbus never runs with -O)
        stored = found.get(item.id)
        if stored is None:
            raise _missing(item.id, i, field)
        out.append(_to_item.decode(stored))
    return out


def _missing(item: str, i: int, field: str) -> InvalidRequest:
    return InvalidRequest(f"Item with id '{item}' not found.", param=f"{field}[{i}].id")
