"""The Files API's routes: a tenant's uploaded files (services.edge.file_store keeps them), bounded by
--max-body-bytes each; a batch input file is checked line by line on upload."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from services.edge.auth import caller_of
from services.edge.file_store import FileInfo
from services.edge.formats import files as shapes
from services.edge.formats.base import encode
from services.edge.formats.common import page_limit
from services.edge.sse import ClientGone
from services.edge.state import FILES, STORE
from shared.protocol.errors import InvalidRequest

MAX_LISTED = 10_000


def _json(value: object) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


async def _form(request: web.Request) -> tuple[str, str, bytes]:
    """The upload's purpose, file name and bytes (multipart/form-data, as the SDKs send it)."""
    if not request.content_type.startswith("multipart/form-data"):
        raise InvalidRequest("Upload a file as multipart/form-data with `file` and `purpose`.", param="file")
    try:  # bounded by --max-body-bytes (a 413 past it), within the body's deadline (services.edge.server)
        form = await request.post()
    except (ValueError, web.RequestPayloadError) as exc:
        raise InvalidRequest(f"The form could not be read: {exc}.", param="file") from None
    except ConnectionResetError:
        raise ClientGone() from None
    purpose, upload = form.get("purpose"), form.get("file")
    if not isinstance(purpose, str) or purpose not in shapes.PURPOSES:
        raise InvalidRequest(f"`purpose` must be one of {', '.join(shapes.PURPOSES)}.", param="purpose")
    if not isinstance(upload, web.FileField):
        raise InvalidRequest("`file` must be a file part of the form.", param="file")
    return purpose, upload.filename or "upload.jsonl", upload.file.read()


async def create(request: web.Request) -> web.Response:
    purpose, filename, data = await _form(request)
    if purpose == "batch":
        await asyncio.to_thread(shapes.batch_lines, data)  # a large file's lines, off the loop
    caller = caller_of(request)
    info = FileInfo(id=f"file-{uuid.uuid4().hex}", bytes=len(data), created_at=int(time.time()), filename=filename,
                    purpose=purpose)
    return _json(await request.app[FILES].put(caller.tenant, request.app[STORE].quota(caller.key), info, data))


async def retrieve(request: web.Request) -> web.Response:
    return _json(await request.app[FILES].info(caller_of(request).tenant, request.match_info["file_id"]))


async def content(request: web.Request) -> web.Response:
    data = await request.app[FILES].content(caller_of(request).tenant, request.match_info["file_id"])
    return web.Response(body=data, content_type="application/octet-stream")


async def delete(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    await request.app[FILES].delete(caller_of(request).tenant, file_id)
    return _json(shapes.DeletedFile(id=file_id))


async def list_files(request: web.Request) -> web.Response:
    """The tenant's files, newest first (`order=desc`, the default), `limit` at a time after `after`; `purpose`
    keeps one kind."""
    limit, order = page_limit(request.query.get("limit", "10000"), MAX_LISTED), request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` is asc or desc.", param="order")
    found = await request.app[FILES].listed(caller_of(request).tenant)
    if purpose := request.query.get("purpose"):
        found = [info for info in found if info.purpose == purpose]
    found = found if order == "asc" else found[::-1]
    if after := request.query.get("after"):
        at = next((i for i, info in enumerate(found) if info.id == after), None)
        found = found[at + 1:] if at is not None else []
    page = found[:limit]
    return _json(shapes.FileList(data=page, first_id=page[0].id if page else None,
                                 last_id=page[-1].id if page else None, has_more=len(found) > limit))
