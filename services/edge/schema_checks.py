"""The checks of a request's JSON schemas and regular expressions that cost by the byte, kept off the event loop.

The format code bounds a schema's size on the loop (one `orjson.dumps`, cheap even at the largest size), then the
schema's shape (depth, alternatives) and the JSON Schema meta-schema are checked (`check_schema`). Those checks
cost by the byte: a typical tool schema's cost next to nothing, but a schema just within the bounds holds the loop
for milliseconds, most of all an array of many `{}` (`prefixItems`), and the meta-schema check costs more than the
shape walk, which goes a level at a time (see `_next_level`). `re.compile` is not bounded by a pattern's length
at all: a class of a few characters spanning all of Unicode (`[\x00-\U0010ffff]`) is slow to compile, and a
pattern of 64 KiB of them takes far longer than any request may. jsonschema-rs and `re` hold the GIL: a thread
would not free the loop. So while a planner builds its job (`deferring()`), the format code defers every pattern,
and every schema beyond the request's first INLINE_SCHEMA_BYTES, and the planner awaits them in the edge's
checking process (`Checker`), all of a request's on one line: the round trip costs the loop less than checking
all but small schemas inline would, and adds its latency to the request. A request's checks must all end within
CHECK_DEADLINE_S of CPU time, or it is refused with a 400 naming the field being checked, and the process is
replaced, so that no check holds the next one (a host too busy to let them finish within BUSY_S: a 503). Without
a collector (unit tests, other callers) the checks run inline, as they did.

The checking process is a helper (shared.runtime.helpers), a fresh interpreter (`python -m
services.edge.schema_checks`: it imports `orjson`, `jsonschema_rs` and this module, nothing else of the edge, so it
starts quickly), started on first use: it reads a request's checks per line on its stdin, answers on its stdout
with the first that failed (or null), and marks the index of the check it is making (read when it takes too
long)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema_rs
import orjson

from shared.protocol.errors import InvalidRequest, Overloaded
from shared.runtime import helpers

log = logging.getLogger(__name__)

MAX_SCHEMA_DEPTH = 64
"""Levels of nesting (objects and arrays of the schema's JSON) a schema may have."""
MAX_SCHEMA_BRANCHES = 512
BRANCHING = frozenset({"anyOf", "oneOf", "allOf"})
INLINE_SCHEMA_BYTES = 2048
"""Of a request's schemas, how many bytes of JSON are checked on the loop: few enough that even the worst such
schemas (all `{}`) hold it only briefly, and typical ones, cheaper to check than a round trip to the checking
process, pay no round trip."""
CHECK_DEADLINE_S = 1.0
"""The CPU time one request's deferred checks may take in the checking process, all told (counted in whole seconds,
so 1 to 2): well above what the slowest requests within the bounds take (a 64 KiB literal pattern, a 64 KiB schema of
`{}`), so that only a check the bounds cannot catch (a pattern slow to compile) reaches it."""
BUSY_S = 10.0
"""How long a request waits for its checks when the host gives the checking process too little CPU to finish
them (a 503, to be tried again): CPU time decides a check, not how busy the host is."""
START_TIMEOUT_S = 30.0
"""How long the checking process may take to start (an interpreter, orjson and jsonschema-rs)."""
READ_LIMIT = 1 << 20
"""The longest answer line read back (an error message quotes part of the schema)."""


# The checks


def check_schema(schema: dict[str, Any], param: str) -> None:
    """Refuses a schema nested deeper than MAX_SCHEMA_DEPTH, with more than MAX_SCHEMA_BRANCHES alternatives
    (anyOf / oneOf / allOf items, all told), or that is not a JSON schema by its meta-schema. Depth and
    alternatives are what make a grammar expensive to compile, beyond its size; they come first."""
    _check_shape(schema, param)
    try:
        jsonschema_rs.meta.validate(schema)
    except (jsonschema_rs.ValidationError, ValueError) as exc:
        message = str(exc).split("\n", 1)[0]
        raise InvalidRequest(f"`{param}` is not a valid JSON schema: {message}", param=param) from None


def _check_shape(schema: dict[str, Any], param: str) -> None:
    branches, level = 0, [schema]
    for _ in range(MAX_SCHEMA_DEPTH):
        level, found = _next_level(level)
        branches += found
        if not level:
            break
    else:
        raise InvalidRequest(f"`{param}` is nested deeper than {MAX_SCHEMA_DEPTH} levels.", param=param)
    if branches > MAX_SCHEMA_BRANCHES:
        raise InvalidRequest(f"`{param}` has {branches} anyOf/oneOf/allOf alternatives; at most "
                             f"{MAX_SCHEMA_BRANCHES} are served.", param=param)


def _next_level(level: list[Any]) -> tuple[list[Any], int]:
    """The objects and arrays one level below these, and the alternatives these hold. The schema is walked a
    level at a time comparing types (JSON gives exact dicts and lists): a small fraction of the time per node
    that a stack of (node, depth) pairs and generators took."""
    below: list[Any] = []
    add = below.append
    branches = 0
    for node in level:
        if type(node) is dict:
            for key, child in node.items():
                kind = type(child)
                if kind is dict:
                    add(child)
                elif kind is list:
                    add(child)
                    if key in BRANCHING:
                        branches += len(child)
        else:
            for child in node:
                kind = type(child)
                if kind is dict or kind is list:
                    add(child)
    return below, branches


def check_regex(pattern: str, param: str) -> None:
    """Compiles the pattern with Python's `re`; its errors (a recursion or an overflow among them) are a 400."""
    try:
        with warnings.catch_warnings():  # a FutureWarning ("possible nested set") is not a refusal
            warnings.simplefilter("ignore")
            re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:  # nested too deeply; a repetition beyond 2**32
        raise InvalidRequest(f"`{param}` is not a valid regular expression: {exc}", param=param) from None


CHECKS: dict[str, Callable[[Any, str], None]] = {"schema": check_schema, "regex": check_regex}


# Deferring them while a job is built


@dataclass(frozen=True)
class Deferred:
    kind: str
    """A key of CHECKS."""
    param: str
    spec: bytes
    """The schema or the pattern as JSON."""


@dataclass
class _Collected:
    checks: list[Deferred] = field(default_factory=list)
    inline_left: int = INLINE_SCHEMA_BYTES
    """Of the request's schemas, how many more bytes may be checked now."""


_COLLECTED: contextvars.ContextVar[_Collected | None] = contextvars.ContextVar("deferred_checks", default=None)


@contextlib.contextmanager
def deferring() -> Iterator[list[Deferred]]:
    """Collects the checks that the format code defers (see `defer`) while the block builds a job; the caller
    runs them with `Checker.run` before the job goes anywhere."""
    collected = _Collected()
    token = _COLLECTED.set(collected)
    try:
        yield collected.checks
    finally:
        _COLLECTED.reset(token)


def defer(kind: str, param: str, spec: bytes) -> bool:
    """Defers a check to the caller of `deferring()`, unless it is cheap enough to make now: a schema while the
    request's schemas checked now stay within INLINE_SCHEMA_BYTES all told (32 tools of 2 KiB each, checked
    inline, would hold the loop far longer than their round trip does), never a pattern. False: check it now
    (nothing collects the checks, or it is cheap)."""
    collected = _COLLECTED.get()
    if collected is None:
        return False
    if kind == "schema" and len(spec) <= collected.inline_left:
        collected.inline_left -= len(spec)
        return False
    collected.checks.append(Deferred(kind, param, spec))
    return True


# The checking process


class Checker:
    """The edge's checking process (shared.runtime.helpers): one request's checks at a time, and at most one
    request of each tenant waiting for it, so a tenant's flood of slow checks makes another tenant's request wait for
    one of them, not for all."""

    def __init__(self, deadline_s: float = CHECK_DEADLINE_S, busy_s: float = BUSY_S) -> None:
        self.deadline_s = deadline_s
        self._helpers = helpers.Helpers("services.edge.schema_checks", deadline_s=busy_s, cpu_s=deadline_s,
                                        start_timeout_s=START_TIMEOUT_S, read_limit=READ_LIMIT)

    async def run(self, pending: list[Deferred], tenant: str) -> None:
        """Makes the checks; the first to fail, in their order, is raised (InvalidRequest, naming its field).
        Sent on one line, answered on one line: the first that failed (its index and message), or null."""
        if not pending:
            return
        line = orjson.dumps([[c.kind, c.param, orjson.Fragment(c.spec)] for c in pending])
        try:
            answer = await self._helpers.ask(line, tenant)
        except helpers.TookTooLong as exc:
            param = pending[min(exc.progress, len(pending) - 1)].param
            log.warning("the checking process took over %g s to check %s; it is replaced", self.deadline_s, param)
            raise InvalidRequest(f"`{param}` took too long to check (over {self.deadline_s:g} s); make it smaller "
                                 "or simpler.", param=param) from None
        except helpers.Ended as exc:
            param = pending[min(exc.progress, len(pending) - 1)].param
            log.warning("the checking process ended while it checked %s", param)
            raise InvalidRequest(f"`{param}` could not be checked.", param=param) from None
        except helpers.Busy:
            log.warning("the checking process was given too little CPU to finish a request's checks; replaced")
            raise Overloaded("The edge is too busy to check this request's schemas now; try again shortly.",
                             ) from None
        except helpers.NotStarted:
            log.warning("the schema checking process did not start")
            raise Overloaded("The edge cannot check schemas now; try again shortly.") from None
        failed: tuple[int, str] | None = orjson.loads(answer)
        if failed is not None:
            index, message = failed
            raise InvalidRequest(message, param=pending[index].param)

    async def close(self) -> None:
        await self._helpers.close()


def _answer(line: bytes, progress: helpers.Progress) -> bytes:
    """The checking process's answer to a request's checks (`[[kind, param, spec], ...]`): the first that failed
    (`[index, message]`), or null."""
    failed = None
    for index, (kind, param, spec) in enumerate(orjson.loads(line)):
        progress.mark(index)
        try:
            CHECKS[kind](spec, param)
        except InvalidRequest as exc:
            failed = [index, exc.message]
            break
    re.purge()  # patterns are not used twice: keep none of them
    return orjson.dumps(failed)


if __name__ == "__main__":
    helpers.serve(_answer)
