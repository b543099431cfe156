"""The internal job and event formats round-trip and tolerate fields added later."""

from __future__ import annotations

import msgspec

from shared.protocol import bus, errors


def test_job_round_trip() -> None:
    job = bus.Job(id="j", model="m", reply_to="r", deadline_ms=5,
                  messages=[bus.Message(role="user", content="hi")],
                  params=bus.SamplingParams(temperature=0, stop=["x"], max_tokens=3))
    assert bus.decode_job(bus.encode_job(job)) == job


def test_events_round_trip_in_one_batch() -> None:
    events: list[bus.Event] = [
        bus.Tokens(job="a", text="x", token_ids=[1], choice=1),
        bus.Final(job="a", prompt_tokens=2, completion_tokens=1),
        bus.Error(job="b", kind="ContextLengthExceeded", message="long", param="messages",
                  code="context_length_exceeded"),
    ]
    assert bus.decode_events(bus.encode_events(events)) == events


def test_an_event_from_a_newer_worker_still_decodes() -> None:
    newer = {"type": "tok", "job": "a", "text": "x", "token_ids": [1], "future_field": {"k": 1}}
    [event] = bus.decode_events(msgspec.msgpack.encode([newer]))
    assert event == bus.Tokens(job="a", text="x", token_ids=[1])


def test_errors_cross_the_bus_with_their_class() -> None:
    original = errors.ContextLengthExceeded("too long", param="messages")
    rebuilt = errors.from_kind(errors.kind_of(original), original.message, original.param, original.code)
    assert isinstance(rebuilt, errors.ContextLengthExceeded)
    assert (rebuilt.status, rebuilt.code, rebuilt.param) == (400, "context_length_exceeded", "messages")
    assert type(errors.from_kind("Unheard", "m", None, None)) is errors.TokenbusError


def test_tools_and_tool_calls_cross_the_bus_and_old_peers_leave_them_out() -> None:
    call = bus.ToolCall(id="call_1", name="f", arguments='{"a": 1}')
    job = bus.Job(id="j", model="m", reply_to="r", deadline_ms=5, messages=[
        bus.Message(role="assistant", content="", tool_calls=[call]),
        bus.Message(role="tool", content="2", tool_call_id="call_1")],
        tool_use=bus.ToolUse(tools=[bus.Tool(name="f", parameters={"type": "object"})], choice="required",
                             parallel=False))
    assert bus.decode_job(bus.encode_job(job)) == job
    event = bus.Tokens(job="j", text="", token_ids=[1], finish_reason="tool_calls",
                       tool_calls=[bus.ToolCallDelta(index=0, id="call_1", name="f"),
                                   bus.ToolCallDelta(index=0, arguments="{}")])
    assert bus.decode_events(bus.encode_events([event])) == [event]
    old = {"type": "tok", "job": "a", "text": "x", "token_ids": [1]}  # from a worker without tool calls
    assert bus.decode_events(msgspec.msgpack.encode([old]))[0].tool_calls == []
    assert b"tool" not in bus.encode_events([bus.Tokens(job="a", text="x", token_ids=[1])])


def test_call_deltas_fold_into_calls() -> None:
    calls: list[bus.ToolCall] = []
    bus.add_call_deltas(calls, [
        bus.ToolCallDelta(index=0, id="c0", name="f"), bus.ToolCallDelta(index=0, arguments='{"a"'),
        bus.ToolCallDelta(index=0, arguments=": 1}"), bus.ToolCallDelta(index=1, id="c1", name="g")])
    assert calls == [bus.ToolCall(id="c0", name="f", arguments='{"a": 1}'),
                     bus.ToolCall(id="c1", name="g", arguments="")]
