"""The Conversations API, driven by the official openai SDK against real processes over the simulated engine:
a conversation's items on any edge, and Responses turns that run after them and add themselves."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from shared.protocol import keys
from tests.stack import Stack
from tests.test_faults import sse_frames


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _texts(items: list[Any]) -> list[tuple[str, str]]:
    """(role, text) of each message item."""
    return [(str(getattr(item, "role", item.type)), "".join(part.text for part in getattr(item, "content", None) or []))
            for item in items]


async def test_a_stored_response_lists_its_own_input_items_on_any_edge(stack: Stack) -> None:
    edge, other_edge = stack.edge(), stack.edge()
    stack.worker()
    given = [{"type": "message", "role": "user", "content": "one"},
             {"type": "message", "role": "assistant", "content": "two", "id": "msg_mine"},
             {"type": "message", "role": "user", "content": "three"}]
    async with _client(edge.url) as client, _client(other_edge.url) as other:
        first = await client.responses.create(model=stack.model, input=given, max_output_tokens=2)
        listed = await other.responses.input_items.list(first.id)
        assert _texts(listed.data) == [("user", "three"), ("assistant", "two"), ("user", "one")]  # newest first
        assert listed.data[1].id == "msg_mine" and len({item.id for item in listed.data}) == 3
        page = await other.responses.input_items.list(first.id, order="asc", limit=2)
        assert _texts(page.data) == [("user", "one"), ("assistant", "two")] and page.has_more
        rest = await client.responses.input_items.list(first.id, order="asc", after=page.last_id)
        assert _texts(rest.data) == [("user", "three")] and not rest.has_more
        second = await client.responses.create(model=stack.model, input="four", max_output_tokens=2,
                                               previous_response_id=first.id)
        assert _texts((await client.responses.input_items.list(second.id)).data) == [("user", "four")]  # its own
        unstored = await client.responses.create(model=stack.model, input="five", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(unstored.id)


async def test_a_background_response_lists_its_input_items_while_it_runs_as_it_will_once_stored(
    stack: Stack,
) -> None:
    edge, other_edge = stack.edge(), stack.edge()
    stack.worker(sim_itl_ms=20)
    given = [{"type": "message", "role": "user", "content": "one"},
             {"type": "message", "role": "user", "content": "two"}]
    async with _client(edge.url) as client, _client(other_edge.url) as other:
        running = await client.responses.create(model=stack.model, input=given, max_output_tokens=150, background=True)
        while_running = await other.responses.input_items.list(running.id, order="asc")
        assert (await other.responses.retrieve(running.id)).status in ("queued", "in_progress")
        for _ in range(100):  # its 150 tokens take 3 s
            if (await client.responses.retrieve(running.id)).status not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.2)
        stored = await client.responses.input_items.list(running.id, order="asc")
    assert _texts(while_running.data) == [("user", "one"), ("user", "two")]
    assert [item.id for item in stored.data] == [item.id for item in while_running.data]


async def test_a_conversation_keeps_its_turns_on_any_edge_and_each_turn_runs_after_them(stack: Stack) -> None:
    edge, other_edge = stack.edge(), stack.edge()
    stack.worker()
    async with _client(edge.url) as client, _client(other_edge.url) as other:
        conversation = await client.conversations.create(
            metadata={"topic": "counting"}, items=[{"type": "message", "role": "user", "content": "hello there"}])
        assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "counting"}
        first = await client.responses.create(model=stack.model, input="count", max_output_tokens=3,
                                              conversation=conversation.id)
        assert first.conversation is not None and first.conversation.id == conversation.id
        listed = await other.conversations.items.list(conversation.id, order="asc")
        assert _texts(listed.data) == [("user", "hello there"), ("user", "count"), ("assistant", " t1 t2 t3")]
        assert listed.data[-1].id == first.output[0].id  # the answer's item is the response's output item
        second = await other.responses.create(model=stack.model, input="more", max_output_tokens=2,
                                              conversation={"id": conversation.id}, store=False)
        assert first.usage is not None and second.usage is not None
        # the second turn ran after everything before it: the first turn's words and its answer's tokens
        assert second.usage.input_tokens == first.usage.input_tokens + 3 + 1
        newest = await client.conversations.items.list(conversation.id, limit=2)  # newest first by default
        assert _texts(newest.data) == [("assistant", " t1 t2"), ("user", "more")] and newest.has_more
        # items added, read, deleted; metadata changed
        added = await client.conversations.items.create(
            conversation.id, items=[{"type": "message", "role": "user", "content": "a note"}])
        note = added.data[0]
        assert (await other.conversations.items.retrieve(note.id, conversation_id=conversation.id)).id == note.id
        await other.conversations.items.delete(note.id, conversation_id=conversation.id)
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.retrieve(note.id, conversation_id=conversation.id)
        updated = await other.conversations.update(conversation.id, metadata={"topic": "done"})
        assert (await client.conversations.retrieve(conversation.id)).metadata == {"topic": "done"} == \
            updated.metadata
        # refusals name their parameter
        with pytest.raises(openai.BadRequestError) as both:
            await client.responses.create(model=stack.model, input="x", conversation=conversation.id,
                                          previous_response_id=first.id)
        assert both.value.body["param"] == "conversation"
        with pytest.raises(openai.BadRequestError) as orphan:
            await client.conversations.items.create(
                conversation.id, items=[{"type": "function_call_output", "call_id": "call_9", "output": "42"}])
        assert orphan.value.body["param"].startswith("items[0]")
        # a call whose output is in the conversation is not deleted before it (the conversation stays usable)
        pair = await client.conversations.items.create(conversation.id, items=[
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"}])
        function_call, output = pair.data
        with pytest.raises(openai.BadRequestError) as answered:
            await client.conversations.items.delete(function_call.id, conversation_id=conversation.id)
        assert answered.value.body["param"] == "item_id" and output.id in answered.value.body["message"]
        await client.conversations.items.delete(output.id, conversation_id=conversation.id)
        await client.conversations.items.delete(function_call.id, conversation_id=conversation.id)
        await client.conversations.items.create(
            conversation.id, items=[{"type": "message", "role": "user", "content": "still usable"}])
        # a turn without input runs on the conversation's items alone (input is optional, as OpenAI's is)
        counted = await client.responses.input_tokens.count(conversation=conversation.id)
        alone = await client.responses.create(model=stack.model, max_output_tokens=2, conversation=conversation.id)
        assert alone.usage is not None and alone.usage.input_tokens == counted.input_tokens > 0
        assert _texts((await other.conversations.items.list(conversation.id, limit=2)).data) == [
            ("assistant", " t1 t2"), ("user", "still usable")]
        with pytest.raises(openai.BadRequestError) as nothing:
            await client.responses.create(model=stack.model, max_output_tokens=2)
        assert nothing.value.body["param"] == "input"
        with pytest.raises(openai.BadRequestError) as too_long:  # the field a response's prompt comes in
            await client.responses.create(model=stack.model, input="sea " * 2_000_000)
        assert (too_long.value.code, too_long.value.param) == ("context_length_exceeded", "input")
        with pytest.raises(openai.BadRequestError) as unknown:  # OpenAI's IncludeEnum, checked
            await client.responses.create(model=stack.model, input="x", include=["bogus.value"])  # type: ignore[list-item]
        assert unknown.value.body["param"] == "include[0]"
        deleted = await client.conversations.delete(conversation.id)
        assert deleted.deleted and deleted.id == conversation.id
        for call in (other.conversations.retrieve(conversation.id),
                     client.responses.create(model=stack.model, input="x", conversation=conversation.id)):
            with pytest.raises(openai.NotFoundError) as gone:
                await call
        assert gone.value.body["param"] == "conversation"
    assert stack.client.hget(keys.storage_tally(""), f"c:{conversation.id}") is None  # its bytes were given back


async def test_a_conversation_holds_no_more_than_one_request_may_carry(stack: Stack) -> None:
    """Each turn sends all of a conversation to the engine, so it is bounded as a request is (here 4,000 bytes):
    reading one costs an edge no more than reading a request."""
    edge = stack.edge(max_body_bytes=4000)
    async with _client(edge.url) as client:
        conversation = await client.conversations.create()
        item: Any = {"type": "message", "role": "user", "content": "x" * 900}
        for _ in range(3):
            await client.conversations.items.create(conversation.id, items=[item])
        with pytest.raises(openai.BadRequestError) as full:
            await client.conversations.items.create(conversation.id, items=[item, item])
        assert full.value.body["param"] == "items"
        listed = await client.conversations.items.list(conversation.id)
    assert len(listed.data) == 3  # the refused items were not half added


async def test_replaying_a_finished_turn_does_not_store_it_again(stack: Stack) -> None:
    """A stream of a conversation's turn replayed after its end is planned again from the conversation, which
    holds the turn by then: storing it again stored that turn twice in its history, and a turn continuing it
    (previous_response_id) ran after both."""
    edge = stack.edge()
    stack.worker()
    async with _client(edge.url) as client, httpx.AsyncClient(timeout=30) as http:
        conversation = await client.conversations.create()
        frames = await sse_frames(http, "POST", edge.url + "/v1/responses", json={
            "model": stack.model, "input": "count", "max_output_tokens": 3, "stream": True,
            "conversation": conversation.id})
        response_id = json.loads(frames[-1][1])["response"]["id"]

        async def continued_input_tokens() -> int:
            after = await client.responses.create(model=stack.model, input="more", max_output_tokens=1,
                                                  previous_response_id=response_id, store=False)
            assert after.usage is not None
            return after.usage.input_tokens

        before = await continued_input_tokens()
        replayed = await sse_frames(http, "GET", f"{edge.url}/v1/streams/{response_id}",
                                    headers={"Last-Event-ID": frames[1][0]})
        assert json.loads(replayed[-1][1])["type"] == "response.incomplete"
        assert await continued_input_tokens() == before
