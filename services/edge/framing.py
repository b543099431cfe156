"""The one transport of renderers' payloads (services.edge.formats.base.Payload): each encoded once with msgspec
into its SSE frame (an `event:` frame for a Named one, `data: [DONE]` for END), or into the JSON body."""

from __future__ import annotations

from services.edge.formats.base import END, TEXT_MARK, Filled, Named, Payload, encode
from services.edge.sse import DONE, data_frame, event_frame

_MARK = encode(TEXT_MARK)


def frame(payload: Payload) -> bytes:
    """The SSE frame of one payload."""
    if type(payload) is Filled:  # most tokens: the one path every streamed token takes, kept short
        template, text = payload
        if not template.head:
            template.head, template.tail = data_frame(encode(template.payload)).split(_MARK)
        return template.head + encode(text) + template.tail
    if isinstance(payload, Named):
        return event_frame(payload.event, encode(payload.payload))
    if payload is END:
        return DONE
    return data_frame(encode(payload))


def frames(payloads: list[Payload]) -> list[bytes]:
    return [frame(payload) for payload in payloads]


def body(payload: Payload) -> bytes:
    """A non-streamed answer's JSON body."""
    return encode(payload)
