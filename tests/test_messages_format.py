"""Anthropic's Messages API at the edge, without Redis: what a conversation with tool results may hold (each
tool_result block is a message of its own to the model, so the blocks a request expands to count against
MAX_MESSAGES, and each call takes one result), refused by the edge's own planners before the model is looked up,
each a 400 in Anthropic's shape naming its field."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from services.edge.formats import messages, messages_render, planners
from services.edge.formats.base import MAX_MESSAGES, decode
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

HI = {"role": "user", "content": "hi"}


def called(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "f", "input": {}} for i in ids]}


def answered(*ids: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "x"} for i in ids]}


def body(conversation: list[dict[str, Any]]) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 8, "messages": conversation}).encode()


def job_of(conversation: list[dict[str, Any]]) -> bus.Job:
    req = decode(body(conversation), messages.MessagesRequest)
    return messages.to_job(req, job_id="msg_1", reply_to="r", deadline_ms=1)


PLANS: list[Callable[[bytes], planners.Planning]] = [planners.plan_messages, planners.plan_count_tokens]


def first_need(plan: Callable[[bytes], planners.Planning], conversation: list[dict[str, Any]]) -> planners.Need:
    """What the planner first asks for but the count of the body's unknown fields (count_tokens knows no
    max_tokens): the model, or raises the request's refusal."""
    planning = plan(body(conversation))
    step = planners.advance(planning)
    while isinstance(step, planners.Ignored):
        step = planners.advance(planning, None)
    assert not isinstance(step, planners.Planned)
    return step


def refused(plan: Callable[[bytes], planners.Planning], conversation: list[dict[str, Any]]) -> InvalidRequest:
    """The planner's refusal, before it asks for the model."""
    with pytest.raises(InvalidRequest) as caught:
        first_need(plan, conversation)
    return caught.value


@pytest.mark.parametrize("plan", PLANS)
def test_one_call_answered_a_hundred_thousand_times_is_refused_by_its_blocks(
        plan: Callable[[bytes], planners.Planning]) -> None:
    """The review's request (7.9 MB: 130,000 results of one call, each a message of its own) ran as 130,002
    messages, 780k tokens counted: a message holds at most MAX_BLOCKS blocks."""
    error = refused(plan, [HI, called("a"), answered(*["a"] * 130_000)])
    assert (error.status, error.param) == (400, "messages[2].content")
    assert "2048" in error.message and "messages[2].content" in error.message


@pytest.mark.parametrize("plan", PLANS)
def test_the_messages_the_blocks_become_count_against_max_messages(plan: Callable[[bytes], planners.Planning]
                                                                    ) -> None:
    """Each message's blocks within MAX_BLOCKS, the conversation's 9 messages within MAX_MESSAGES: with its
    tool results a message each, it holds 4 x 1,000 + 5 = 4,005."""
    ids = [f"toolu_{n}" for n in range(1000)]
    conversation = [HI, called(*ids), answered(*ids)] + [called(*ids), answered(*ids)] * 3
    error = refused(plan, conversation)
    assert (error.status, error.param) == (400, "messages")
    assert "4005" in error.message and str(MAX_MESSAGES) in error.message
    body_of = msgspec.json.decode(msgspec.json.encode(messages_render.error_body(error)))
    assert body_of == {"type": "error", "error": {"type": "invalid_request_error", "message": error.message}}
    assert "`messages`" in error.message


def test_a_conversation_of_max_messages_with_its_results_is_served() -> None:
    """2,048 messages once expanded: the user's text, one call, and the 2,046 results of that call's message."""
    ids = [f"toolu_{n}" for n in range(MAX_MESSAGES - 2)]
    job = job_of([HI, called(*ids), answered(*ids)])
    assert len(job.messages) == MAX_MESSAGES
    assert [m.tool_call_id for m in job.messages[2:]] == ids
    ids.append("toolu_more")
    with pytest.raises(InvalidRequest) as caught:
        job_of([HI, called(*ids), answered(*ids)])
    assert caught.value.param == "messages"
    texts = {"role": "user", "content": [{"type": "text", "text": "x"}] * messages.MAX_BLOCKS}
    assert len(job_of([texts]).messages) == 1  # text blocks join one message
    with pytest.raises(InvalidRequest) as caught:
        job_of([{"role": "user", "content": [{"type": "text", "text": "x"}] * (messages.MAX_BLOCKS + 1)}])
    assert caught.value.param == "messages[0].content"


@pytest.mark.parametrize("plan", PLANS)
def test_a_call_answered_twice_is_refused(plan: Callable[[bytes], planners.Planning]) -> None:
    """Anthropic refuses a second tool_result for one tool_use_id (a 400), as OpenAI a second tool message."""
    step = first_need(plan, [HI, called("a", "b"), answered("a", "b")])
    assert isinstance(step, planners.Model)  # the same conversation, each call answered once: on to the model
    with pytest.raises(InvalidRequest) as caught:
        job_of([HI, called("a", "b"), answered("a", "b", "a")])
    assert (caught.value.status, caught.value.param) == (400, "messages[2].content[2].tool_use_id")
    assert "'a'" in caught.value.message and "messages[2].content[2].tool_use_id" in caught.value.message
    with pytest.raises(InvalidRequest) as caught:
        job_of([HI, called("a"), answered("a"), called("b"), answered("a")])
    assert caught.value.param == "messages[4].content[0].tool_use_id"
    with pytest.raises(InvalidRequest) as caught:
        job_of([HI, called("a"), answered("c")])
    assert caught.value.param == "messages[2].content[0].tool_use_id" and "no earlier" in caught.value.message


def test_a_call_made_again_with_its_id_is_answered_again() -> None:
    """A later turn's call of the same id (ids that restart each turn) is a new call, with a result of its own."""
    job = job_of([HI, called("f:0"), answered("f:0"), called("f:0"), answered("f:0")])
    assert [(m.role, m.tool_call_id) for m in job.messages] == [
        ("user", ""), ("assistant", ""), ("tool", "f:0"), ("assistant", ""), ("tool", "f:0")]
