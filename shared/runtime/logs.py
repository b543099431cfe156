"""How every tokenbus process logs: one line per record, as text or as JSON (`--log-format json`), with the
request id of the request being served when there is one. Records never carry prompts, completions or API
keys: only ids, counts and reasons are logged anywhere."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import time
from collections.abc import Iterator

import orjson

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""The id of the request the current task serves (the edge's request, or the worker's job)."""
VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
"""What a client may send as x-request-id; anything else is replaced by an id of our own."""


@contextlib.contextmanager
def about(request_id: str) -> Iterator[None]:
    """Log records made inside the block name this request (for code that serves many, like a listener)."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class _WithRequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, process role, logger, message, request id, exception."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "role": self.role, "logger": record.name, "message": record.getMessage()}
        if request_id := getattr(record, "request_id", ""):
            line["request_id"] = request_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure(role: str, level: str, fmt: str) -> None:
    """Sets up the root logger of a process: `fmt` text or json."""
    handler = logging.StreamHandler()
    handler.addFilter(_WithRequestId())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {role} %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
