"""The Files API's routes: a tenant's uploaded files (services.edge.file_store keeps them), bounded by
--max-body-bytes each; a batch input file is checked line by line on upload."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from services.edge import sending
from services.edge.auth import caller_of
from services.edge.file_store import FileInfo
from services.edge.formats import files as shapes
from services.edge.formats.base import encode
from services.edge.formats.common import page_limit
from services.edge.sse import ClientGone
from services.edge.state import FILES, SETTINGS, STORE
from shared.protocol.errors import InvalidRequest

MAX_LISTED = 10_000
"""The largest `limit` OpenAI's files list takes."""
MAX_PAGE = 100
"""The most files one page holds."""


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
    caller = caller_of(request)
    if request.content_length:  # a full store refuses the upload before its bytes are read
        await request.app[STORE].check_room(caller.tenant, caller.key, request.content_length,
                                            "the file could not be stored", "file")
    purpose, filename, data = await _form(request)
    if purpose == "batch":
        await asyncio.to_thread(shapes.batch_lines, data)  # a large file's lines, off the loop
    info = FileInfo(id=f"file-{uuid.uuid4().hex}", bytes=len(data), created_at=int(time.time()), filename=filename,
                    purpose=purpose)
    return _json(await request.app[FILES].put(caller.tenant, request.app[STORE].quota(caller.key), info, data))


async def retrieve(request: web.Request) -> web.Response:
    return _json(await request.app[FILES].info(caller_of(request).tenant, request.match_info["file_id"]))


async def content(request: web.Request) -> web.StreamResponse:
    """A file's bytes, sent a chunk at a time, each write within --write-stall-s (services.edge.sending): a
    download holds one chunk on the edge, and not for good."""
    info, chunks = await request.app[FILES].chunks(caller_of(request).tenant, request.match_info["file_id"])
    return await sending.send(request, chunks, content_type="application/octet-stream", length=info.bytes,
                              stall_s=request.app[SETTINGS].write_stall_s)


async def delete(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    await request.app[FILES].delete(caller_of(request).tenant, file_id)
    return _json(shapes.DeletedFile(id=file_id))


async def list_files(request: web.Request) -> web.Response:
    """The tenant's files, newest first (`order=desc`, the default), `limit` at a time after `after`; `purpose`
    keeps one kind. Any `limit` OpenAI takes (up to 10,000) is taken; a page holds at most MAX_PAGE (`has_more`
    and `after` page on, as the SDKs do), so one call reads and sends a bounded part of the tenant's files."""
    limit = min(page_limit(request.query.get("limit", str(MAX_PAGE)), MAX_LISTED), MAX_PAGE)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("`order` is asc or desc.", param="order")
    page, more = await request.app[FILES].page(caller_of(request).tenant, limit, newest_first=order == "desc",
                                               after=request.query.get("after", ""),
                                               purpose=request.query.get("purpose", ""))
    return _json(shapes.FileList(data=page, first_id=page[0].id if page else None,
                                 last_id=page[-1].id if page else None, has_more=more))
