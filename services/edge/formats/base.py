"""What every format shares: lenient request decoding, output structs, per-choice accumulation."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple, Protocol, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from services.edge.store import Turn
from shared.protocol import bus
from shared.protocol.errors import ContextLengthExceeded, InvalidRequest, TokenbusError
from shared.runtime import gcheap

T = TypeVar("T")


class Request(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """Base of client request structs: unknown fields are ignored (and counted), never fatal."""


def unbuilt() -> Any:
    """A field kept as its JSON text (checked to be JSON, never built into objects): one the edge only refuses
    when given, or ignores. However large or deep, it costs what skipping an unknown field does; built, a body of
    millions of small arrays held the event loop for seconds."""
    return msgspec.field(default_factory=msgspec.Raw)


def given(raw: msgspec.Raw) -> bool:
    """Whether an `unbuilt` field asks for something: it was sent, and is not null, an empty list or object."""
    return bytes(raw).strip() not in (b"", b"null", b"[]", b"{}")


class Out(msgspec.Struct, kw_only=True):
    """Base of response structs: every field is sent, `null` included, except those left UNSET."""


# MindIE's limits on stop sequences (the strictest the seeds give that still fits OpenAI clients).
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
StopList = Annotated[list[StopString], msgspec.Meta(max_length=1024)]
MAX_STOP_CHARS = 32768
MAX_MESSAGES = 2048
"""Messages of one conversation (Chat's `messages`, Responses' input items with the history they continue): the
worker renders and tokenizes each (2,048 take it well under half a second, truncation included)."""

MAX_NESTS = 250_000
"""The most `[` and `{` bytes a request body may hold (in its strings too: counting them is one pass in C, telling
them apart is not). Every array and object of a body is built into Python objects as it is decoded, ~0.1 us each
on the event loop: this keeps a body's at ~25 ms whatever it holds (8 MB of `[[],[],...` made 2.7 million). A
conversation of the most messages, with tools, takes a few tens of thousands; a prompt reaches the bound only with
megabytes of JSON text, far past the context of today's models."""

_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")


def _param_of(message: str) -> tuple[str, str | None]:
    """Splits msgspec's error text into a message and the dotted path of the field at fault."""
    path: str | None = None
    if match := _AT.search(message):
        path = match["path"] or None
        message = message[: match.start()]
    if missing := _MISSING.search(message):
        path = f"{path}.{missing['field']}" if path else missing["field"]
    return message, path


def decode(body: bytes, kind: type[T]) -> T:
    """Decodes and validates a request body; every failure is an InvalidRequest naming the field."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    check_nests(body)
    try:
        with gcheap.collector_paused():
            return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        message, param = _param_of(str(exc))
        where = f" (at `{param}`)" if param else ""
        raise InvalidRequest(f"Invalid value{where}: {message}", param=param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec raises it, not a DecodeError, for bad bytes inside a string
        raise InvalidRequest(f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    except RecursionError:  # msgspec descends once per level of nesting, on this thread's stack
        raise InvalidRequest("The request body is nested too deeply.") from None


def check_nests(body: bytes, where: str = "The request body", **error: Any) -> None:
    """Refuses a body with more `[` and `{` than MAX_NESTS, before any of it is built (`error`: the
    InvalidRequest's param and code)."""
    if len(body) > MAX_NESTS and (nests := body.count(b"[") + body.count(b"{")) > MAX_NESTS:
        raise InvalidRequest(f"{where} holds {nests} '[' and '{{' characters, in its arrays, objects and strings "
                             f"together; at most {MAX_NESTS} are taken.", **error)


def unknown_fields(body: bytes, kind: type[msgspec.Struct]) -> list[str]:
    """Top-level fields of a (valid) body that the struct does not know (the struct skipped them unread: a name
    that is not UTF-8 is refused here)."""
    keys = decode(body, dict[str, msgspec.Raw])
    return [key for key in keys if key not in _field_names(kind)]


@functools.cache
def _field_names(kind: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(kind.__struct_fields__)


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """Normalizes `stop` to a list and enforces the total-length limit."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if sum(map(len, stops)) > MAX_STOP_CHARS:
        raise InvalidRequest(f"`{param}` may hold at most {MAX_STOP_CHARS} characters in all.", param=param)
    return stops


def refuse_beyond_context(max_tokens: int | None, max_model_len: int, param: str) -> None:
    """Refuses at the edge a completion budget that alone leaves no room in the model's context (whose
    length comes with the worker's heartbeat; 0 means unknown), rather than letting it run to its deadline."""
    if max_tokens is not None and 0 < max_model_len <= max_tokens:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens, prompt and completion together; "
            f"`{param}` asks for {max_tokens}, which leaves no room for the prompt.", param=param)


def refuse(param: str, why: str) -> InvalidRequest:
    """The error for a parameter we understand but cannot honour."""
    return InvalidRequest(f"`{param}` is not supported: {why}", param=param, code="unsupported_parameter")


class CompletionTokensDetails(Out):
    reasoning_tokens: int = 0


class Usage(Out, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET
    reasoning_tokens: int | UnsetType = UNSET
    """Databricks' place for them, beside OpenAI's `completion_tokens_details`: only when a model reasoned."""


def usage_of(event: bus.Final, details: bool = False) -> Usage:
    """The usage; `details`: with the reasoning tokens (which `completion_tokens` includes)."""
    return Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
        completion_tokens_details=(CompletionTokensDetails(reasoning_tokens=event.reasoning_tokens)
                                   if details else UNSET),
        reasoning_tokens=event.reasoning_tokens if details and event.reasoning_tokens else UNSET,
    )


class Choices:
    """Per-choice text, logprobs and finish reasons, and the job's Final, gathered from its events."""

    def __init__(self, count: int) -> None:
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.logprobs: list[list[bus.TokenLogprob]] = [[] for _ in range(count)]
        self.finish_reasons: list[str | None] = [None] * count
        self.calls: list[list[bus.ToolCall]] = [[] for _ in range(count)]
        self.reasonings: list[list[str]] = [[] for _ in range(count)]
        self.final: bus.Final | None = None

    def add(self, event: bus.Tokens) -> None:
        self.texts[event.choice].append(event.text)
        if event.reasoning:
            self.reasonings[event.choice].append(event.reasoning)
        bus.add_call_deltas(self.calls[event.choice], event.tool_calls)
        if event.logprobs:
            self.logprobs[event.choice].extend(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reasons[event.choice] = event.finish_reason

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def reasoning(self, index: int) -> str:
        return "".join(self.reasonings[index])


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's words: the engine's "abort" only reaches clients that left, anything else is a stop (or the
    worker's "tool_calls": the model stopped after making calls)."""
    return reason if reason in (None, "stop", "length", "tool_calls") else "stop"


Payload = Any
"""What a renderer hands the transport (services.edge.framing) for one frame: a struct, dict or list (one `data:`
frame, or the JSON body), a Named one (an `event:` frame), a Filled template, or END."""


class Named(NamedTuple):
    """A payload sent as an SSE event of its own name (the Responses stream's `event:` lines)."""

    event: str
    payload: Any


class End:
    """The end of an OpenAI-style stream: `data: [DONE]`."""


END = End()

TEXT_MARK = "\x00tokenbus-text\x00"


class TextTemplate:
    """A chunk with TEXT_MARK where its text goes: the transport encodes its frame once and fills in each
    token's text, which costs one string encode instead of building and encoding the chunk's structs for every
    token."""

    def __init__(self, payload: Any) -> None:
        self.payload = payload
        self.head = self.tail = b""
        """The frame around the text, made by the transport on first use."""

    def fill(self, text: str) -> Filled:
        return Filled(self, text)


class Filled(NamedTuple):
    template: TextTemplate
    text: str


class Renderer(Protocol):
    """A format's state machine: internal events in, payloads out (the transport frames or encodes them)."""

    def render(self, event: bus.Output) -> list[Payload]:
        """The payloads this event produces (streaming; also recorded for `body`)."""
        ...

    def to_store(self) -> Turn | None:
        """Once the Final event was seen: what the caller stores before the Final's frames are sent (None:
        nothing)."""
        ...

    def done(self) -> list[Payload]:
        """Streaming: the payloads of the frames that close a finished stream."""
        ...

    def error(self, error: TokenbusError) -> list[Payload]:
        """Streaming: the payloads of the frames that report an error after the stream began."""
        ...

    def body(self) -> Payload:
        """Non-streaming: the whole response, once every event was passed to `frames`."""
        ...


class ErrorDetail(Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Out):
    error: ErrorDetail


def openai_error_body(error: TokenbusError) -> ErrorBody:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return ErrorBody(error=ErrorDetail(message=error.message, type=error.type, param=error.param, code=error.code))


def openai_error(error: TokenbusError) -> bytes:
    return msgspec.json.encode(openai_error_body(error))


class Unstored:
    """A format whose answers the edge does not store."""

    def to_store(self) -> Turn | None:
        return None


class PromptCount(Unstored):
    """A prompt counted and not run (count_only): the worker's Final carries the count; `answer` shapes it and
    `error_shape` a refusal, in the API's own shapes (never streamed)."""

    def __init__(self, answer: Callable[[int], Any], error_shape: Callable[[TokenbusError], Any]) -> None:
        self.answer = answer
        self.error_shape = error_shape
        self.final: bus.Final | None = None

    def render(self, event: bus.Output) -> list[Payload]:
        if isinstance(event, bus.Final):
            self.final = event
        return []

    def done(self) -> list[Payload]:
        return []

    def error(self, error: TokenbusError) -> list[Payload]:
        return [self.error_shape(error)]

    def body(self) -> Any:
        return self.answer(self.final.prompt_tokens if self.final else 0)


class OpenAIStreamEnd(Unstored):
    """How OpenAI's Chat Completions and Completions streams end: `[DONE]`, after an error frame if any."""

    def done(self) -> list[Payload]:
        return [END]

    def error(self, error: TokenbusError) -> list[Payload]:
        return [openai_error_body(error), END]


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)

