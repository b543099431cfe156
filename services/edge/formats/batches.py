"""The OpenAI Batch API's shapes: the create request, the Batch object, its list, and the lines of its output and
error files."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from services.edge.batch_store import Batch
from services.edge.formats.base import Out, decode
from services.edge.formats.files import BATCH_URLS
from shared.protocol.errors import InvalidRequest

MAX_WINDOW_S = 7 * 24 * 3600
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

ACTIVE = ("validating", "in_progress", "cancelling", "finalizing")
"""A batch in one of these states is open: an edge drives it to its end."""


class CreateBatch(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


class BatchList(Out):
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


def window_s(given: str) -> int:
    """A completion window in seconds: OpenAI's `24h`, or any `<n>s|m|h|d` up to a week."""
    found = _WINDOW.match(given)
    seconds = int(found.group(1)) * _UNIT_S[found.group(2)] if found else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise InvalidRequest("`completion_window` must be `24h` (or a duration such as `30m`, up to `7d`).",
                             param="completion_window")
    return seconds


def create_request(body: bytes) -> CreateBatch:
    request = decode(body, CreateBatch)
    if request.endpoint not in BATCH_URLS:
        raise InvalidRequest(f"`endpoint` must be one of {', '.join(BATCH_URLS)}.", param="endpoint")
    window_s(request.completion_window)
    if request.metadata is not None and (len(request.metadata) > 16 or any(
            len(key) > 64 or len(value) > 512 for key, value in request.metadata.items())):
        raise InvalidRequest("`metadata` holds at most 16 pairs, keys up to 64 characters, values up to 512.",
                             param="metadata")
    return request


def line_id(job_id: str) -> str:
    """The id of a line of the output (the job of line 7 of batch_ab12 is batch_ab12_7: batch_req_ab12_7)."""
    return "batch_req_" + job_id.removeprefix("batch_")


def answered(job_id: str, custom_id: str, body: bytes) -> bytes:
    """A line of the output file: the request's answer, as its endpoint gave it."""
    return b'{"id":%s,"custom_id":%s,"response":{"status_code":200,"request_id":%s,"body":%s},"error":null}' % (
        msgspec.json.encode(line_id(job_id)), msgspec.json.encode(custom_id), msgspec.json.encode(job_id), body)


def refused(job_id: str, custom_id: str, status: int, error: bytes) -> bytes:
    """A line of the error file for a request its endpoint answered with an error (`error`: its JSON body)."""
    return b'{"id":%s,"custom_id":%s,"response":{"status_code":%d,"request_id":%s,"body":%s},"error":null}' % (
        msgspec.json.encode(line_id(job_id)), msgspec.json.encode(custom_id), status, msgspec.json.encode(job_id),
        error)


def unrun(job_id: str, custom_id: str, code: str, message: str) -> bytes:
    """A line of the error file for a request the batch never ran (it expired, or the batch was cancelled)."""
    return msgspec.json.encode({"id": line_id(job_id), "custom_id": custom_id, "response": None,
                                "error": {"code": code, "message": message}})
