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
from services.edge.formats import item_refs
from services.edge.formats.base import decode, encode
from services.edge.formats.common import page_limit
from services.edge.formats.responses import InputItem
from services.edge.plans import referenced
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
    items = shapes.added(await _resolved(request, req.items or []), [], header.id)
    await request.app[CONVERSATIONS].create(caller.tenant, request.app[STORE].quota(caller.key), header, items)
    return _json(_resource(header))


async def _resolved(request: web.Request, items: list[InputItem]) -> list[InputItem]:
    """Items to add, each `item_reference` replaced by the caller's stored item it names (see item_refs), as a
    Responses turn's input reads them: the conversation keeps a copy, under the item's own id."""
    if not (wanted := item_refs.references(items, "items")):
        return items
    found = await referenced(request.app, caller_of(request).tenant, wanted, "items")
    return item_refs.resolved(items, found, "items")


async def _header(request: web.Request) -> Header:
    return await request.app[CONVERSATIONS].header(caller_of(request).tenant, request.match_info["conversation_id"])


async def retrieve(request: web.Request) -> web.Response:
    return _json(_resource(await _header(request)))


async def update(request: web.Request) -> web.Response:
    req = decode(await read_body(request), shapes.UpdateConversationBody)
    stored = await _header(request)
    caller = caller_of(request)
    header = Header(id=stored.id, created_at=stored.created_at, metadata=req.metadata)
    await request.app[CONVERSATIONS].set_header(caller.tenant, request.app[STORE].quota(caller.key), header)
    return _json(_resource(header))


async def delete(request: web.Request) -> web.Response:
    conversation_id = request.match_info["conversation_id"]
    await request.app[CONVERSATIONS].delete(caller_of(request).tenant, conversation_id)
    return _json(shapes.DeletedConversation(id=conversation_id))


def _limit(request: web.Request) -> int:
    return page_limit(request.query.get("limit", "20"), MAX_LISTED)


async def list_items(request: web.Request) -> web.Response:
    """Its items, newest first (`order=desc`, the default) or oldest first, `limit` at a time after `after`: only
    the page is read whole (see ConversationStore.page)."""
    limit, newest_first = _limit(request), _newest_first(request)
    after = request.query.get("after", "")
    found = await request.app[CONVERSATIONS].page(caller_of(request).tenant, request.match_info["conversation_id"],
                                                  limit, newest_first, after)
    if found is None:
        raise NotFound(f"No item with id '{after}' in the conversation.", param="after")
    page, more = found
    return _json(shapes.ItemList(data=page, first_id=page[0]["id"] if page else None,
                                 last_id=page[-1]["id"] if page else None, has_more=more))


def _newest_first(request: web.Request) -> bool:
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` is asc or desc.", param="order")
    return order == "desc"


def item_page(request: web.Request, items: list[dict[str, Any]], whose: str) -> shapes.ItemList:
    """A page of items (a conversation's, a stored response's input) as the query asks: newest first
    (`order=desc`, the default) or oldest first, `limit` at a time after the item `after`."""
    limit = _limit(request)
    items = items[::-1] if _newest_first(request) else items
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
    items = shapes.added(await _resolved(request, req.items), stored.items, stored.header.id)
    await request.app[CONVERSATIONS].append(caller.tenant, request.app[STORE].quota(caller.key), stored.header.id,
                                            items)
    data = [shapes.decode_item(item) for item in items]
    return _json(shapes.ItemList(data=data, first_id=data[0]["id"], last_id=data[-1]["id"], has_more=False))


async def _item(request: web.Request) -> tuple[Header, dict[str, Any], bytes]:
    item_id = request.match_info["item_id"]
    found = await request.app[CONVERSATIONS].item(caller_of(request).tenant, request.match_info["conversation_id"],
                                                  item_id)
    if found is None:
        raise NotFound(f"No item with id '{item_id}' in the conversation.", param="item_id")
    return found


async def retrieve_item(request: web.Request) -> web.Response:
    return _json((await _item(request))[1])


async def delete_item(request: web.Request) -> web.Response:
    """Removes one item; a function call whose output is still there stays (its output answers nothing without
    it, and every later turn of the conversation would be refused for it): the output goes first."""
    header, found, value = await _item(request)
    if found.get("type") == "function_call":
        stored, _ = await _load(request)
        answer = next((item for item in stored.items if item.get("type") == "function_call_output"
                       and item.get("call_id") == found.get("call_id")), None)
        if answer is not None:
            raise InvalidRequest(f"The function call's output (item '{answer.get('id')}') is still in the "
                                 "conversation: delete it first.", param="item_id")
    await request.app[CONVERSATIONS].remove(caller_of(request).tenant, header.id, value)
    return _json(_resource(header))

