"""The Batch API's routes: a batch is created over a batch input file, driven by the edges
(services.edge.batch_driver), read and listed by its tenant, and cancelled."""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from services.edge.auth import caller_of
from services.edge.batch_driver import BATCH_DRIVER
from services.edge.batch_store import Batch, RequestCounts
from services.edge.formats import batches as shapes
from services.edge.formats.base import encode
from services.edge.formats.common import page_limit
from services.edge.server import read_body
from services.edge.state import BATCHES, FILES, SETTINGS, STORE
from shared.protocol.errors import InvalidRequest
from shared.runtime import metrics

MAX_LISTED = 100


def _json(value: object) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


async def create(request: web.Request) -> web.Response:
    asked = shapes.create_request(await read_body(request))
    caller, files = caller_of(request), request.app[FILES]
    info = await files.info(caller.tenant, asked.input_file_id, param="input_file_id")
    if info.purpose != "batch":
        raise InvalidRequest("The input file must be uploaded with purpose `batch`.", param="input_file_id")
    await request.app[BATCHES].check_open(caller.tenant, request.app[SETTINGS].batch_max_open)
    data = await files.content(caller.tenant, asked.input_file_id, param="input_file_id")
    total = sum(1 for raw in data.splitlines() if raw.strip())  # its lines were checked on upload
    now = int(time.time())
    batch = Batch(id=f"batch_{uuid.uuid4().hex}", endpoint=asked.endpoint, input_file_id=asked.input_file_id,
                         completion_window=asked.completion_window, status="validating", created_at=now,
                         expires_at=now + shapes.window_s(asked.completion_window), metadata=asked.metadata,
                         request_counts=RequestCounts(total=total))
    await request.app[BATCHES].create(caller.tenant, caller.key_id, batch, request.app[SETTINGS].batch_max_open,
                                      request.app[STORE].quota(caller.key))
    metrics.BATCHES.labels("created").inc()
    await request.app[BATCH_DRIVER].begin(caller.tenant, batch.id)
    return _json(batch)


async def retrieve(request: web.Request) -> web.Response:
    found = await request.app[BATCHES].get(caller_of(request).tenant, request.match_info["batch_id"])
    return _json(found.batch)


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/batches/{id}/cancel: the batch is cancelling until its driver stops its lines (a second or so);
    one that ended stays as it ended."""
    tenant, batch_id = caller_of(request).tenant, request.match_info["batch_id"]
    store = request.app[BATCHES]
    found = await store.get(tenant, batch_id)
    if found.batch.status in ("validating", "in_progress"):
        await store.ask_cancel(tenant, batch_id)
        found = await store.get(tenant, batch_id)
    elif found.batch.status != "cancelling":
        raise InvalidRequest(f"The batch is {found.batch.status}: only a batch that is validating or in progress "
                             "can be cancelled.", param="batch_id", code="batch_not_cancellable")
    return _json(found.batch)


async def list_batches(request: web.Request) -> web.Response:
    """The tenant's batches, newest first, `limit` (1 to 100, 20 by default) at a time after `after`."""
    limit = page_limit(request.query.get("limit", "20"), MAX_LISTED)
    tenant, store = caller_of(request).tenant, request.app[BATCHES]
    ids = await store.ids(tenant)
    if after := request.query.get("after"):
        ids = ids[ids.index(after) + 1:] if after in ids else []
    page: list[Batch] = []
    gone: list[str] = []
    for batch_id in ids:
        if len(page) > limit:
            break
        found = await store.load(tenant, batch_id)
        if found is None:
            gone.append(batch_id)
        else:
            page.append(found.batch)
    await store.forget(tenant, gone)
    shown = page[:limit]
    return _json(shapes.BatchList(data=shown, first_id=shown[0].id if shown else None,
                                  last_id=shown[-1].id if shown else None, has_more=len(page) > limit))
