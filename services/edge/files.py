"""The Files API's routes: a tenant's uploaded files (services.edge.file_store keeps them), bounded by
--max-body-bytes each; a batch input file is checked line by line on upload."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import BodyPartReader, web
from aiohttp.hdrs import CONTENT_DISPOSITION
from aiohttp.http_exceptions import HttpProcessingError

from services.edge import sending
from services.edge.auth import caller_of
from services.edge.file_store import FileInfo
from services.edge.formats import files as shapes
from services.edge.formats.base import encode
from services.edge.formats.common import page_limit
from services.edge.sse import ClientGone
from services.edge.state import FILES, SETTINGS, STORE
from shared.protocol.errors import InvalidRequest, PayloadTooLarge

MAX_LISTED = 10_000
"""The largest `limit` OpenAI's files list takes."""
MAX_PAGE = 100
"""The most files one page holds."""
MAX_FORM_PARTS = 8
"""Parts an upload's form may have: OpenAI's has two (`file`, `purpose`). aiohttp's own form reading takes up to
1,000, and parses each part's Content-Disposition three times, at about half a microsecond a character of escapes:
one 8 MiB upload of 500 parts of 16 KiB each held the edge's loop 23 s."""
MAX_DISPOSITION_CHARS = 1024
"""A part's Content-Disposition (its name and file name), checked before it is parsed (its parse is what costs)."""
MAX_PURPOSE_BYTES = 64
"""Read of the `purpose` part: every purpose is a short word."""


def _json(value: object) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


async def _form(request: web.Request) -> tuple[str, str, bytes]:
    """The upload's purpose, file name and bytes (multipart/form-data, as the SDKs send it)."""
    if not request.content_type.startswith("multipart/form-data"):
        raise InvalidRequest("Upload a file as multipart/form-data with `file` and `purpose`.", param="file")
    try:  # within the body's deadline (services.edge.server)
        fields = await _parts(request, request.app[SETTINGS].max_body_bytes)
    except (ValueError, RuntimeError, HttpProcessingError, web.RequestPayloadError) as exc:
        # aiohttp's reader raises these on a broken form (a part's header line too long: a 500 and a trace before)
        raise InvalidRequest(f"The form could not be read: {type(exc).__name__}.", param="file") from None
    except ConnectionResetError:
        raise ClientGone() from None
    purpose, upload = fields.get("purpose"), fields.get("file")
    if purpose is None or purpose[1] is not None or purpose[0].decode(errors="replace") not in shapes.PURPOSES:
        raise InvalidRequest(f"`purpose` must be one of {', '.join(shapes.PURPOSES)}.", param="purpose")
    if upload is None or upload[1] is None:
        raise InvalidRequest("`file` must be a file part of the form.", param="file")
    return purpose[0].decode(), upload[1] or "upload.jsonl", upload[0]


async def _parts(request: web.Request, max_bytes: int) -> dict[str, tuple[bytes, str | None]]:
    """The form's `purpose` and `file` parts (their bytes and file name, None for a plain field), read part by part
    rather than with aiohttp's `request.post()`: at most MAX_FORM_PARTS parts, each Content-Disposition checked
    for size before it is parsed, the whole body within `max_bytes` (a 413 past it)."""
    fields: dict[str, tuple[bytes, str | None]] = {}
    reader = await request.multipart()
    for _ in range(MAX_FORM_PARTS + 1):
        part = await reader.next()
        if part is None:
            return fields
        if not isinstance(part, BodyPartReader):
            raise InvalidRequest("A form of the upload holds another multipart body.", param="file")
        if len(part.headers.get(CONTENT_DISPOSITION, "")) > MAX_DISPOSITION_CHARS:
            raise InvalidRequest(f"A part's Content-Disposition is longer than {MAX_DISPOSITION_CHARS} characters.",
                                 param="file")
        if part.name in ("purpose", "file") and part.name not in fields:
            limit = MAX_PURPOSE_BYTES if part.name == "purpose" else max_bytes
            fields[part.name] = await _part_bytes(request, part, limit, max_bytes), part.filename
        else:  # any other part (OpenAI's form has none) is skipped, not kept
            await _part_bytes(request, part, 0, max_bytes)
    raise InvalidRequest(f"An upload's form may have at most {MAX_FORM_PARTS} parts.", param="file")


async def _part_bytes(request: web.Request, part: BodyPartReader, keep: int, max_bytes: int) -> bytes:
    """The part's first `keep` bytes (more is a 400), its raw bytes as sent; the body's bytes so far checked
    against `max_bytes` at every chunk."""
    kept = bytearray()
    while chunk := await part.read_chunk():
        if request.content.total_bytes > max_bytes:
            raise PayloadTooLarge(f"The request body is larger than {max_bytes} bytes.")
        if len(kept) + len(chunk) > keep:
            if keep:
                raise InvalidRequest(f"`{part.name}` is longer than {keep} bytes.", param=part.name)
            continue
        kept += chunk
    return bytes(kept)


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
