"""The worker's reasoning parsers on answers in the formats their models write (Qwen3 thinking and not,
DeepSeek-R1 whose template opens the block), cut at every character boundary and one character at a time:
the same reasoning and the same answer come out however the text arrives, a model that does not think is
served unchanged, and the reasoning tokens are counted. Chained with a tool parser, a call made after the
reasoning is found in the answer only."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from services.worker.parsing.formats import tool_format
from services.worker.parsing.output import JobOutput, for_job
from services.worker.parsing.reasoning import ReasoningParser, Split, ThinkParser, reasoning_format
from services.worker.parsing.tools import MAX_HELD_WHITESPACE
from shared.protocol import bus

QWEN3_FORMAT = reasoning_format("qwen3")
R1_FORMAT = reasoning_format("deepseek_r1")
assert QWEN3_FORMAT is not None and R1_FORMAT is not None
QWEN3, R1 = QWEN3_FORMAT.make, R1_FORMAT.make

# (name, parser, text, reasoning, answer)
SAMPLES: list[tuple[str, Callable[[], ReasoningParser], str, str, str]] = [
    ("qwen3-thinking", QWEN3, "<think>\nThe user greets me. Answer briefly, in French: « Bonjour ».\n</think>\n\n"
                              "Bonjour ! Comment puis-je vous aider ?",
     "The user greets me. Answer briefly, in French: « Bonjour ».", "Bonjour ! Comment puis-je vous aider ?"),
    ("qwen3-not-thinking", QWEN3, "Paris is the capital of France.", "", "Paris is the capital of France."),
    ("qwen3-markup-answer", QWEN3, "<b>bold</b> and a < b; <thinking> is no tag", "",
     "<b>bold</b> and a < b; <thinking> is no tag"),
    ("qwen3-leading-space", QWEN3, "  <think>a 東京 plan</think>Done.", "a 東京 plan", "Done."),
    ("qwen3-cut-while-thinking", QWEN3, "<think>\nStep 1: count the letters. Step 2: ", "Step 1: count the letters. "
                                                                                        "Step 2:", ""),
    ("qwen3-empty-block", QWEN3, "<think>\n\n</think>\n\nHello.", "", "Hello."),
    ("qwen3-tag-later-is-text", QWEN3, "Sure. <think>x</think> stays", "", "Sure. <think>x</think> stays"),
    ("r1-opened-by-template", R1, "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is **4**.", "Okay, 2 + 2 is 4.",
     "The answer is **4**."),
    ("r1-writes-the-tag-anyway", R1, "<think>\nHmm, ü.\n</think>\nYes.", "Hmm, ü.", "Yes."),
    ("r1-cut-while-thinking", R1, "Let me think about </thi", "Let me think about </thi", ""),
    ("r1-partial-open-tag-then-text", R1, "<thin and more", "<thin and more", ""),
    # of a run of whitespace a parser drops at most MAX_HELD_WHITESPACE (256): the rest goes on as text
    ("qwen3-long-spaces", QWEN3, " " * 300 + "<think>plan" + " " * 300 + "</think>" + " " * 300 + "Done.",
     "plan" + " " * 44, "Done."),
]


def run(make: Callable[[], ReasoningParser], pieces: list[str]) -> Split:
    parser, out = make(), Split()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


@pytest.mark.parametrize(("name", "make", "text", "reasoning", "answer"), SAMPLES, ids=[s[0] for s in SAMPLES])
def test_the_split_is_the_same_however_the_text_is_cut(
    name: str, make: Callable[[], ReasoningParser], text: str, reasoning: str, answer: str
) -> None:
    whole = run(make, [text])
    assert (whole.reasoning, whole.content) == (reasoning, answer)
    assert run(make, list(text)) == whole
    for cut in range(1, len(text)):
        assert run(make, [text[:cut], text[cut:]]) == whole, f"cut at {cut}"


def test_nothing_is_put_out_that_more_text_could_change() -> None:
    """Each prefix gives a prefix of the final reasoning and answer (what went out is never taken back)."""
    for _name, make, text, reasoning, answer in SAMPLES:
        parser, out = make(), Split()
        for char in text:
            out.extend(parser.feed(char))
            assert reasoning.startswith(out.reasoning) and answer.startswith(out.content)


def test_an_unknown_parser_is_named_and_none_is_no_parser() -> None:
    assert reasoning_format("none") is None and reasoning_format("") is None
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_format("granite")


def tokens(text: str, count: int, finish: str | None = None) -> bus.Tokens:
    return bus.Tokens(job="j", text=text, token_ids=list(range(count)), finish_reason=finish)


def chat_job(**fields: object) -> bus.Job:
    return bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, kind="chat", **fields)


def test_a_job_streams_reasoning_then_content_and_counts_the_reasoning_tokens() -> None:
    output = for_job(chat_job(), tool_format("hermes"), QWEN3_FORMAT)
    assert output is not None
    pieces = [("<think>", 1), ("\nPlan", 1), (" it.", 2), ("\n</think>", 2), ("\n\nDo", 1), ("ne.", 1)]
    events = [e for text, n in pieces for e in output.rewrite(tokens(text, n))]
    events += output.rewrite(tokens("", 0, finish="stop"))
    final = output.rewrite(bus.Final(job="j", prompt_tokens=3, completion_tokens=8))[0]
    sent = [e for e in events if isinstance(e, bus.Tokens)]
    assert "".join(e.reasoning for e in sent) == "Plan it."
    assert "".join(e.text for e in sent) == "Done."
    assert isinstance(final, bus.Final) and final.reasoning_tokens == 6


def test_a_call_after_the_reasoning_is_a_call_and_one_inside_it_is_not() -> None:
    use = bus.ToolUse(tools=[bus.Tool(name="get_time")], choice="auto")
    output = for_job(chat_job(tool_use=use), tool_format("hermes"), QWEN3_FORMAT)
    assert isinstance(output, JobOutput)
    text = ('<think>I could write <tool_call>{"name": "nope"}</tool_call> here.</think>\n'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Lima"}}</tool_call>')
    events = [e for char in text for e in output.rewrite(tokens(char, 1))]
    events += output.rewrite(tokens("", 0, finish="stop"))
    sent = [e for e in events if isinstance(e, bus.Tokens)]
    calls: list[bus.ToolCall] = []
    for e in sent:
        bus.add_call_deltas(calls, e.tool_calls)
    assert "".join(e.reasoning for e in sent) == 'I could write <tool_call>{"name": "nope"}</tool_call> here.'
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"city": "Lima"}')]
    assert sent[-1].finish_reason == "tool_calls"


def test_a_constrained_answer_is_read_only_where_the_model_opens_the_block_and_a_completion_never() -> None:
    """A JSON answer must not be taken for reasoning by a parser that assumes the template opened the block;
    a parser whose model writes the tag lets the text decide (a regex may ask for the block)."""
    fmt = tool_format("hermes")
    held = chat_job(params=bus.SamplingParams(constraint=bus.Constraint(kind="json_object")))
    assert for_job(held, fmt, R1_FORMAT) is None
    output = for_job(held, fmt, QWEN3_FORMAT)
    assert output is not None
    assert [(e.reasoning, e.text) for e in output.rewrite(tokens('{"a": 1}', 3, finish="stop"))
            if isinstance(e, bus.Tokens)] == [("", '{"a": 1}')]
    completion = bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, kind="completion")
    assert for_job(completion, fmt, QWEN3_FORMAT) is None
    assert for_job(chat_job(), fmt, None) is None


def test_a_continued_job_picks_up_its_reasoning_where_the_former_owner_left_it() -> None:
    """The new owner reads the carried tokens again: the reasoning the client has must match."""
    said = "<think>half a thought"
    decode: Callable[[list[int]], str] = lambda ids: said  # noqa: E731
    sent = bus.Continuation(token_ids=[[1, 2, 3]], finished=[False], texts=[""], reasonings=["half a thought"])
    output = for_job(chat_job(), tool_format("hermes"), QWEN3_FORMAT)
    assert output is not None and output.resume(sent, decode)
    rest = output.rewrite(tokens(" and the rest</think>Answer.", 4, finish="stop"))
    assert [(e.reasoning, e.text) for e in rest if isinstance(e, bus.Tokens)] == [(" and the rest", "Answer.")]
    final = output.rewrite(bus.Final(job="j", prompt_tokens=1, completion_tokens=7))[0]
    assert isinstance(final, bus.Final) and final.reasoning_tokens == 7
    other = for_job(chat_job(), tool_format("hermes"), QWEN3_FORMAT)
    assert other is not None
    assert not other.resume(msgspec_replace(sent, reasonings=["something else"]), decode)


def msgspec_replace(c: bus.Continuation, **fields: object) -> bus.Continuation:
    return msgspec.structs.replace(c, **fields)


def test_think_parser_tags_are_settable() -> None:
    split = run(lambda: ThinkParser(open_tag="<reasoning>", close_tag="</reasoning>"),
                ["<reasoning>a</reason", "ing>b"])
    assert (split.reasoning, split.content) == ("a", "b")


def test_a_long_run_of_whitespace_is_not_held_whole() -> None:
    """Reasoning that is whitespace for a whole budget: the parser holds at most MAX_HELD_WHITESPACE of it."""
    parser = QWEN3()
    parser.feed("<think>plan")
    for _ in range(5000):
        parser.feed(" " * 16)
        assert len(parser.held) <= MAX_HELD_WHITESPACE + 16
    assert parser.finish().reasoning.strip() == ""
