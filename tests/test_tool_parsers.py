"""The worker's tool parsers on recorded model answers and on the formats' own samples: the same content and
calls come out however the text is cut (at every character boundary, one character at a time, and every
prefix fed at once gives what the pieces gave so far), text that is no call passes unchanged, and the calls
have the shape the edge renders. The engine streams whole characters (it holds back an incomplete UTF-8
sequence), so character boundaries are the byte boundaries a parser can meet; the samples include multi-byte
text."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from services.worker.parsing.tools import (
    MAX_HELD_WHITESPACE,
    JsonParser,
    NamedParser,
    Parsed,
    TaggedParser,
    ToolParser,
)
from shared.protocol import bus

RECORDED = json.loads((Path(__file__).parent / "data" / "recorded_tool_outputs.json").read_text())
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}

Make = Callable[[Callable[[int], str]], ToolParser]

# the formats as their models' documentation shows them (Hermes 2 Pro / Qwen 2.5, Llama 3.1), and edge cases
SAMPLES: list[tuple[str, Make, str]] = [
    ("qwen", TaggedParser, 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
                           '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                           '{"city": "東京"}}\n</tool_call>'),
    ("tag-then-text", TaggedParser, '<tool_call>{"name":"get_time","arguments":{"city":"Lima"}}</tool_call>\nDone: '
                                    '"a < b" holds.'),
    ("string-arguments", TaggedParser, '<tool_call>\n{"arguments": "{\\"city\\": \\"Paris\\"}", "name": '
                                       '"get_weather"}\n</tool_call>'),
    ("no-call", TaggedParser, "Use <b>bold</b> and a < b; a <tool_call> tag alone is text: <tool_call> hi"),
    ("unclosed", TaggedParser, 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    ("llama", JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'),
    ("llama-two", JsonParser, '{"name": "get_time", "parameters": {"city": "Tokyo"}}; '
                              '{"name": "get_time", "parameters": {"city": "Lima"}}'),
    ("array-then-text", JsonParser, ' [{"name": "get_time", "arguments": {"city": "Oslo"}}]  Asked.'),
    ("plain", JsonParser, "The weather in Paris is mild; {curly} text stays."),
    ("json-answer", JsonParser, '{"answer": 42, "unit": "ü"}'),
    ("long-spaces-around-a-tag", TaggedParser, "Checking." + " " * 300 + '<tool_call>{"name": "get_time", "arguments"'
                                               ': {"city": "Lima"}}' + " " * 300 + "</tool_call>" + " " * 300
                                               + "Done." + " " * 300),
    ("long-spaces-around-json", JsonParser, " " * 300 + '[{"name": "get_time", "arguments": {"city": "Oslo"}}]'
                                            + " " * 300 + "Asked." + " " * 300),
]
RECORDED_SAMPLES: list[tuple[str, Make, str]] = [
    *((f"hermes-{i}", TaggedParser, text) for i, text in enumerate(RECORDED["hermes"])),
    *((f"json-{i}", JsonParser, text) for i, text in enumerate(RECORDED["json_prefixed"])),
    *((f"required-{i}", JsonParser, text) for i, text in enumerate(RECORDED["required"])),
]
ALL = SAMPLES + RECORDED_SAMPLES


def ids(n: int) -> str:
    return f"call_{n}"


def feed(make: Make, pieces: list[str], finish: bool = True) -> Parsed:
    parser = make(ids)
    out = Parsed()
    for piece in pieces:
        out.extend(parser.feed(piece))
    if finish:
        out.extend(parser.finish())
    return out


def merged(parsed: Parsed) -> list[str | bus.ToolCallDelta]:
    """The pieces with adjacent text joined and adjacent argument fragments of a call joined: what a client
    makes of them, in order."""
    out: list[str | bus.ToolCallDelta] = []
    for piece in parsed.pieces:
        last = out[-1] if out else None
        if isinstance(piece, str) and isinstance(last, str):
            out[-1] = last + piece
        elif (isinstance(piece, bus.ToolCallDelta) and isinstance(last, bus.ToolCallDelta) and not piece.id
              and not last.id and last.index == piece.index):
            out[-1] = bus.ToolCallDelta(index=piece.index, arguments=last.arguments + piece.arguments)
        else:
            out.append(piece)
    return out


def result(parsed: Parsed) -> tuple[str, list[bus.ToolCall]]:
    calls: list[bus.ToolCall] = []
    bus.add_call_deltas(calls, parsed.calls)
    return parsed.text, calls


@pytest.mark.parametrize(("name", "make", "text"), ALL, ids=[name for name, _m, _t in ALL])
def test_the_same_calls_come_out_however_the_text_is_cut(name: str, make: Make, text: str) -> None:
    whole = feed(make, [text])
    for cut in range(len(text) + 1):
        assert merged(feed(make, [text[:cut], text[cut:]])) == merged(whole), f"cut at {cut}"
    one_by_one = make(ids)
    so_far = Parsed()
    for end, char in enumerate(text, start=1):
        so_far.extend(one_by_one.feed(char))
        assert merged(so_far) == merged(feed(make, [text[:end]], finish=False)), f"after {end} characters"
    so_far.extend(one_by_one.finish())
    assert merged(so_far) == merged(whole)


@pytest.mark.parametrize(("name", "make", "text"), ALL, ids=[name for name, _m, _t in ALL])
def test_text_without_a_call_passes_unchanged_and_calls_have_their_shape(name: str, make: Make, text: str) -> None:
    parsed = feed(make, [text])
    content, calls = result(parsed)
    if not calls:
        assert content == text
        return
    assert [c.id for c in calls] == [ids(n) for n in range(len(calls))]
    for delta in parsed.calls:  # a call's first delta opens it; the others only carry arguments
        assert (delta.name != "") == (delta.id != "") and (not delta.id or delta.arguments == "")
    assert all(c.name and c.arguments for c in calls)


def test_the_formats_samples_give_their_calls() -> None:
    expected = {
        "qwen": ("I will check both.", [("get_weather", {"city": "Zürich", "unit": "celsius"}),
                                        ("get_time", {"city": "東京"})]),
        "tag-then-text": ('\nDone: "a < b" holds.', [("get_time", {"city": "Lima"})]),
        "string-arguments": ("", [("get_weather", {"city": "Paris"})]),
        "llama": ("", [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        "llama-two": ("", [("get_time", {"city": "Tokyo"}), ("get_time", {"city": "Lima"})]),
        "array-then-text": ("Asked.", [("get_time", {"city": "Oslo"})]),
    }
    for name, make, text in SAMPLES:
        if name in expected:
            content, calls = result(feed(make, [text]))
            assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == expected[name], name


def test_a_call_cut_short_keeps_what_was_written() -> None:
    content, [call] = result(feed(TaggedParser, [dict((n, t) for n, _m, t in SAMPLES)["unclosed"]]))
    assert (content, call.name, call.arguments) == ("Sure", "get_weather", '{"city": "Pa')


def test_recorded_answers_of_the_small_model() -> None:
    """What a 135M model really writes: one good tagged call, garbage that stays text, calls with odd names."""
    hermes = [result(feed(TaggedParser, [text])) for text in RECORDED["hermes"]]
    assert [(c.name, json.loads(c.arguments)) for c in hermes[3][1]] == [
        ("time_in_lima", {"time_in_lima": "2023-01-01T00:00:00Z"})]
    assert hermes[1] == (RECORDED["hermes"][1], [])  # `"name":<function-name>` is no JSON: all text
    assert hermes[5][0].startswith("\n\nThe `2022-20-22` means")  # text after the call stays content
    cut_mid_object = result(feed(JsonParser, [RECORDED["json_prefixed"][2]]))
    assert cut_mid_object[1][0].arguments == "{}" and cut_mid_object[0].startswith('"description"')


def test_required_answers_are_calls_that_validate() -> None:
    """The answers a `required` tool choice forced: every call that was finished validates."""
    finished = 0
    for text in RECORDED["required"]:
        content, calls = result(feed(JsonParser, [text]))
        assert content == "" and calls
        for call in calls if text.rstrip().endswith("]") else calls[:-1]:
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
            finished += 1
    assert finished >= 5


def test_a_named_function_takes_the_whole_answer_as_its_arguments() -> None:
    parsed = feed(lambda i: NamedParser("get_weather", i), ["  ", '{\n  "city"', ': "Paris"\n}', "\n "])
    assert parsed.calls[0] == bus.ToolCallDelta(index=0, id="call_0", name="get_weather")
    assert result(parsed) == ("", [bus.ToolCall(id="call_0", name="get_weather", arguments='{\n  "city": "Paris"\n}')])
    empty = result(feed(lambda i: NamedParser("f", i), [""]))
    assert empty == ("", [bus.ToolCall(id="call_0", name="f", arguments="{}")])


@pytest.mark.parametrize("start", ["Text.", '<tool_call>{"name": "get_time", "arguments": {}}', "", '{"name": "f"'])
@pytest.mark.parametrize("make", [TaggedParser, JsonParser, lambda call_id: NamedParser("f", call_id)],
                         ids=["tagged", "json", "named"])
def test_a_long_run_of_whitespace_is_not_held_whole(make: Make, start: str) -> None:
    """A tenant can have the model write whitespace for its whole budget (a logit_bias on a token of spaces): a
    parser holds at most MAX_HELD_WHITESPACE of it, where each token was copied and scanned again with all the
    whitespace before it (quadratic on the worker's loop: seconds for a few thousand tokens)."""
    parser = make(ids)
    parser.feed(start)
    for _ in range(5000):
        parser.feed(" " * 16)
        assert len(parser.pending) <= MAX_HELD_WHITESPACE + 16
    parser.finish()
