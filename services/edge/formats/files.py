"""The OpenAI Files API's shapes, and the check of a batch input file (JSONL: one request per line) on upload."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from services.edge.file_store import FileInfo
from services.edge.formats.base import Out, check_nests
from shared.protocol.errors import InvalidRequest
from shared.runtime import gcheap

PURPOSES = ("batch", "user_data")
"""What a file may be uploaded for: batch input, or a user's own data (kept, never read by tokenbus)."""
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_BATCH_LINES = 50_000
"""OpenAI's bound on the requests of one batch input file."""


class BatchLine(msgspec.Struct, forbid_unknown_fields=False):
    custom_id: str
    method: Literal["POST"]
    url: str
    body: msgspec.Raw
    """The request as its JSON text (an object): a batch is held for as long as it runs, and its lines built
    into objects took seven times the file's bytes of the edge's memory."""

    def head(self) -> LineHead:
        """The few fields of the body a batch reads before the line's planner does."""
        return _decode_head(self.body)

    def inputs(self) -> int:
        """The inputs of an embeddings request (a list's items; else one)."""
        given = _decode_input(self.body).input
        return len(_decode_items(given)) if bytes(given).lstrip()[:1] == b"[" else 1


class LineHead(msgspec.Struct):
    model: Any = None
    stream: Any = None
    background: Any = None


class _Input(msgspec.Struct):
    input: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))


_decode_head = msgspec.json.Decoder(LineHead).decode
_decode_input = msgspec.json.Decoder(_Input).decode
_decode_items = msgspec.json.Decoder(list[msgspec.Raw]).decode


class FileList(Out):
    data: list[FileInfo]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class DeletedFile(Out):
    id: str
    object: str = "file"
    deleted: bool = True


_decode_line = msgspec.json.Decoder(BatchLine).decode


def batch_lines(data: bytes) -> list[BatchLine]:
    """The requests of a batch input file, or a 400 naming the first line that is not one (1-based, as an
    editor shows it): each a JSON object with a unique `custom_id`, `method` POST, one of BATCH_URLS and a
    `body` object."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        line = _line(raw, number)
        if line.custom_id in seen:
            raise InvalidRequest(f"Line {number}: `custom_id` {line.custom_id!r} is used twice; each line needs its "
                                 "own.", param="file", code="invalid_batch_file")
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > MAX_BATCH_LINES:
            raise InvalidRequest(f"A batch file holds at most {MAX_BATCH_LINES} requests.", param="file",
                                 code="invalid_batch_file")
    if not lines:
        raise InvalidRequest("The batch file holds no requests.", param="file", code="invalid_batch_file")
    return lines


def _line(raw: bytes, number: int) -> BatchLine:
    """Line `number` of a batch input file, or a 400 naming it."""
    check_nests(raw, f"Line {number} of the file", param="file", code="invalid_batch_file")
    try:
        with gcheap.collector_paused():
            line = _decode_line(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(f"Line {number} of the file is not a batch request: {exc}.", param="file",
                             code="invalid_batch_file") from None
    except UnicodeDecodeError as exc:  # msgspec raises it, not a DecodeError, for bad bytes inside a string
        raise InvalidRequest(f"Line {number} of the file is not valid UTF-8 (byte {exc.start}).", param="file",
                             code="invalid_batch_file") from None
    except RecursionError:  # msgspec descends once per level of nesting
        raise InvalidRequest(f"Line {number} of the file is nested too deeply.", param="file",
                             code="invalid_batch_file") from None
    if bytes(line.body).lstrip()[:1] != b"{":
        raise InvalidRequest(f"Line {number} of the file is not a batch request: its `body` is not an object.",
                             param="file", code="invalid_batch_file")
    if line.url not in BATCH_URLS:
        raise InvalidRequest(f"Line {number}: `url` must be one of {', '.join(BATCH_URLS)}.", param="file",
                             code="invalid_batch_file")
    return line
