"""The Conversations API's routes: a tenant's conversations and their items (services.edge.conversation_store
keeps them); a Responses call with `conversation` runs after its items and adds its turn to them."""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from services.edge.auth import caller_of
from services.edge.conversation_store import Header, Stored
from services.edge.formats import conversation_items as shapes
from services.edge.formats.base import decode, encode
from services.edge.formats.common import page_limit
from services.edge.server import read_body
from services.edge.state import CONVERSATIONS, STORE
from shared.protocol.errors import InvalidRequest, NotFound

MAX_LISTED = 100


def _json(value: object) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


def _resource(header: Header) -> shapes.ConversationResource:
    return shapes.ConversationResource(id=header.id, created_at=header.created_at, metadata=header.metadata)


async def _load(request: web.Request) -> tuple[Stored, list[bytes]]:
    return await request.app[CONVERSATIONS].load(caller_of(request).tenant, request.match_info["conversation_id"])


async def create(request: web.Request) -> web.Response:
    body = await read_body(request)
    req = decode(body, shapes.CreateConversationBody) if body.strip() else shapes.CreateConversationBody()
    caller = caller_of(request)
    header = Header(id=f"conv_{uuid.uuid4().hex}", created_at=int(time.time()), metadata=req.metadata or {})
    items = shapes.added(req.items or [], [])
    await request.app[CONVERSATIONS].create(caller.tenant, request.app[STORE].quota(caller.key), header, items)
    return _json(_resource(header))


async def retrieve(request: web.Request) -> web.Response:
    stored, _ = await _load(request)
    return _json(_resource(stored.header))


async def update(request: web.Request) -> web.Response:
    req = decode(await read_body(request), shapes.UpdateConversationBody)
    stored, _ = await _load(request)
    caller = caller_of(request)
    header = Header(id=stored.header.id, created_at=stored.header.created_at, metadata=req.metadata)
    await request.app[CONVERSATIONS].set_header(caller.tenant, request.app[STORE].quota(caller.key), header)
    return _json(_resource(header))


async def delete(request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    await request.app[CONVERSATIONS].delete(caller_of(request).tenant, conversation_id)
    return _json(shapes.DeletedConversation(id=conversation_id))


def _limit(request: web.Request) -> int:
    return page_limit(request.query.get("limit", "20"), MAX_LISTED)


async def list_items(request: web.Request) -> web.Response:
    """Its items, newest first (`order=desc`, the default) or oldest first, `limit` at a time after `after`."""
    _limit(request)  # a bad limit is refused before anything is read
    stored, _ = await _load(request)
    return _json(item_page(request, stored.items, "the conversation"))


def item_page(request: web.Request, items: list[dict[str, Any]], whose: str) -> shapes.ItemList:
    """A page of items (a conversation's, a stored response's input) as the query asks: newest first
    (`order=desc`, the default) or oldest first, `limit` at a time after the item `after`."""
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` is asc or desc.", param="order")
    limit = _limit(request)
    items = items if order == "asc" else items[::-1]
    if after := request.query.get("after"):
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise NotFound(f"No item with id '{after}' in {whose}.", param="after")
        items = items[at + 1:]
    page = items[:limit]
    return shapes.ItemList(data=page, first_id=page[0]["id"] if page else None,
                           last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


async def add_items(request: web.Request) -> web.Response:
    req = decode(await read_body(request), shapes.AddItemsBody)
    stored, _ = await _load(request)
    caller = caller_of(request)
    items = shapes.added(req.items, stored.items)
    await request.app[CONVERSATIONS].append(caller.tenant, request.app[STORE].quota(caller.key), stored.header.id,
                                            items)
    data = [shapes.decode_item(item) for item in items]
    return _json(shapes.ItemList(data=data, first_id=data[0]["id"], last_id=data[-1]["id"], has_more=False))


def _item(stored: Stored, raw: list[bytes], item_id: str) -> tuple[dict[str, object], bytes]:
    for item, value in zip(stored.items, raw, strict=True):
        if item.get("id") == item_id:
            return item, value
    raise NotFound(f"No item with id '{item_id}' in the conversation.", param="item_id")


async def retrieve_item(request: web.Request) -> web.Response:
    stored, raw = await _load(request)
    return _json(_item(stored, raw, request.match_info["item_id"])[0])


async def delete_item(request: web.Request) -> web.Response:
    """Removes one item; a function call whose output is still there stays (its output answers nothing without
    it, and every later turn of the conversation would be refused for it): the output goes first."""
    stored, raw = await _load(request)
    found, value = _item(stored, raw, request.match_info["item_id"])
    if found.get("type") == "function_call":
        answer = next((item for item in stored.items if item.get("type") == "function_call_output"
                       and item.get("call_id") == found.get("call_id")), None)
        if answer is not None:
            raise InvalidRequest(f"The function call's output (item '{answer.get('id')}') is still in the "
                                 "conversation: delete it first.", param="item_id")
    await request.app[CONVERSATIONS].remove(caller_of(request).tenant, stored.header.id, value)
    return _json(_resource(stored.header))

