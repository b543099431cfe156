"""A job's text through the worker's parsers (events rewritten per choice, their order kept, the finish reason
of a choice that made calls), a job continued on another worker (its parsers brought back from the tokens
already generated, or worker_lost when that would not match what its client has), and the messages a chat
template gets."""

from __future__ import annotations

import json

from services.worker import conversation
from services.worker.ownership import continuation_of
from services.worker.parsing.formats import tool_format
from services.worker.parsing.output import call_id, for_job
from services.worker.parsing.tools import JsonParser, NamedParser, TaggedParser
from shared.protocol import bus

WEATHER = bus.Tool(name="get_weather", description="The weather in a city.",
                   parameters={"type": "object", "properties": {"city": {"type": "string"}}})
HERMES = tool_format("hermes")
ANSWER = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def job(choice: str = "auto", name: str = "", messages: list[bus.Message] | None = None) -> bus.Job:
    return bus.Job(id="job-1", model="m", reply_to="r", deadline_ms=0,
                   messages=messages or [bus.Message(role="user", content="Weather in Paris?")],
                   tool_use=bus.ToolUse(tools=[WEATHER], choice=choice, name=name))


def tokens(text: str, n: int, finish: str | None = None) -> bus.Tokens:
    return bus.Tokens(job="job-1", text=text, token_ids=[n], finish_reason=finish)


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def run(text: str, size: int = 3, finish: str | None = "stop") -> list[bus.Tokens]:
    """The events of an answer cut in pieces of `size` characters; `finish` None: one still running."""
    output = for_job(job(), HERMES)
    assert output is not None
    chunks = pieces(text, size)
    events = [e for i, chunk in enumerate(chunks)
              for e in output.rewrite(tokens(chunk, i, finish if i == len(chunks) - 1 else None))]
    assert all(isinstance(e, bus.Tokens) for e in events)
    return events  # type: ignore[return-value]


def test_which_parser_a_job_gets() -> None:
    assert for_job(bus.Job(id="j", model="m", reply_to="r", deadline_ms=0), HERMES) is None
    assert for_job(job("none"), HERMES) is None
    for use, parser in ((job("function", "get_weather"), NamedParser), (job("required"), JsonParser),
                        (job(), TaggedParser)):
        output = for_job(use, HERMES)
        assert output is not None and output.make is not None and isinstance(output.make(str), parser)


def test_events_carry_content_and_call_deltas_and_end_with_tool_calls() -> None:
    events = run(ANSWER)
    assert "".join(e.text for e in events) == "Let me look."
    calls: list[bus.ToolCall] = []
    for e in events:
        bus.add_call_deltas(calls, e.tool_calls)
    assert calls == [bus.ToolCall(id=call_id("job-1", 0, 0), name="get_weather", arguments='{"city": "Paris"}')]
    assert [e.finish_reason for e in events][-1] == "tool_calls"
    assert sum(len(e.token_ids) for e in events) == len(pieces(ANSWER, 3))  # every token still counted


def test_a_cut_answer_stays_length_and_a_plain_one_stop() -> None:
    assert run(ANSWER[:-20], finish="length")[-1].finish_reason == "length"
    assert run("Just words.")[-1].finish_reason == "stop"


def test_content_after_a_call_in_the_same_event_comes_after_it() -> None:
    output = for_job(job(), HERMES)
    assert output is not None
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> Then this.'
    events = output.rewrite(bus.Tokens(job="job-1", text=text, token_ids=[1, 2], finish_reason="stop",
                                       stop_reason=None))
    assert [(e.text, bool(e.tool_calls), e.token_ids, e.finish_reason) for e in events] == [
        ("", True, [1, 2], None), (" Then this.", False, [], "tool_calls")]


def test_call_ids_are_the_same_on_every_worker_and_differ_between_calls() -> None:
    assert call_id("job-1", 0, 0) == call_id("job-1", 0, 0)
    assert len({call_id("job-1", 0, 0), call_id("job-1", 0, 1), call_id("job-1", 1, 0), call_id("job-2", 0, 0)}) == 4
    assert call_id("job-1", 0, 0).startswith("call_")


def continued(cut: int, decode: str | None = None) -> tuple[bool, list[bus.Tokens]]:
    """The answer's first `cut` pieces from a former owner (as its log holds them), the rest from a new one."""
    chunks = pieces(ANSWER, 4)
    first = run("".join(chunks[:cut]), size=4, finish=None)  # the former owner died mid-answer
    taken: list[bus.Event] = [*first]
    continuation = continuation_of(job(), taken)
    output = for_job(job(), HERMES)
    assert output is not None
    ok = output.resume(continuation, lambda ids: "".join(chunks[:cut]) if decode is None else decode)
    rest = [e for i, chunk in enumerate(chunks[cut:], start=cut)
            for e in output.rewrite(tokens(chunk, i, "stop" if i == len(chunks) - 1 else None))]
    return ok, [*first, *rest]  # type: ignore[list-item]


def test_a_continued_job_sends_what_the_uninterrupted_one_would() -> None:
    whole = run(ANSWER, size=4)
    expected: list[bus.ToolCall] = []
    for e in whole:
        bus.add_call_deltas(expected, e.tool_calls)
    for cut in range(1, len(pieces(ANSWER, 4))):
        ok, events = continued(cut)
        calls: list[bus.ToolCall] = []
        for e in events:
            bus.add_call_deltas(calls, e.tool_calls)
        assert ok
        assert ("".join(e.text for e in events), calls) == ("".join(e.text for e in whole), expected), cut


def test_a_continuation_that_would_not_match_is_refused() -> None:
    ok, _events = continued(8, decode="Something else entirely")
    assert not ok


# the messages a template gets


def conversation_job(choice: str = "auto") -> bus.Job:
    call = bus.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    return job(choice, messages=[
        bus.Message(role="system", content="Be brief."),
        bus.Message(role="user", content="Weather in Paris?"),
        bus.Message(role="assistant", content="", tool_calls=[call]),
        bus.Message(role="tool", content="18 C, sunny", tool_call_id="call_1"),
    ])


def test_a_template_with_tools_gets_them_and_the_calls_in_its_terms() -> None:
    messages, tools = conversation.render(conversation_job(), HERMES, native=True)
    assert tools == [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                       "parameters": WEATHER.parameters}}]
    assert messages[2]["tool_calls"] == [{"id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1", "name": "get_weather"}
    assert conversation.render(conversation_job("none"), HERMES, native=True)[1] is None


def test_a_template_without_tools_gets_them_written_in_the_worker_s_format() -> None:
    messages, tools = conversation.render(conversation_job(), HERMES, native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and "<tool_call>" in system
    assert json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0])["function"]["name"] == "get_weather"
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert messages[2]["content"] == f"<tool_call>\n{call}\n</tool_call>"
    assert all(isinstance(m["content"], str) for m in messages)
    plain = conversation.render(conversation_job(), tool_format("json"), native=False)[0]
    assert plain[2]["content"] == call
    forced = conversation.render(conversation_job("required"), HERMES, native=False)[0]
    assert "JSON array" in forced[0]["content"] and "<tool_call>" not in forced[0]["content"].split("</tools>")[1]
    silent = conversation.render(conversation_job("none"), HERMES, native=False)[0]
    assert silent[0]["content"] == "Be brief."


def test_which_templates_use_tools() -> None:
    assert conversation.template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not conversation.template_uses_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert conversation.template_uses_tools({"default": "x", "tool_use": "{{ tools }}"})
    assert not conversation.template_uses_tools(None)


def test_without_parallel_calls_only_the_first_call_of_an_auto_answer_is_kept() -> None:
    single = job()
    assert single.tool_use is not None
    single.tool_use.parallel = False
    output = for_job(single, HERMES)
    assert output is not None
    two = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n' \
          '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'
    calls: list[bus.ToolCall] = []
    for i, chunk in enumerate(pieces(two, 5)):
        for event in output.rewrite(tokens(chunk, i, "stop" if i == len(pieces(two, 5)) - 1 else None)):
            bus.add_call_deltas(calls, event.tool_calls)
    assert [json.loads(c.arguments) for c in calls] == [{"city": "A"}]
