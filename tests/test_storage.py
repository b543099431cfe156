"""Each tenant's storage is bounded, against real processes (a redis-server run as tokenbus runs it, two
`tokenbus edge --auth keys`, a simulated worker) with the official SDK as the client: stored responses and
resumable streams count against a byte and an item quota, deletes and expiry give the space back, keys made
without limits get the deployment's, conversations are stored as they were run and without copies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from services.edge.store import REFERENCED_BODIES, SNAPSHOT_EVERY
from services.supervisor import REDIS_MAXMEMORY_BYTES
from shared.protocol import keys
from tests.processes import metric_value
from tests.stack import Stack
from tests.test_tenancy import create_key

CONTEXT = 80_000
"""The simulated worker's context, in its tokens (one a word)."""
DEFAULT_ITEMS = 4
"""The deployment's --storage-items: what a key made without limits may hold."""
SHORT_TTL_S = 1.5
SMALL_BODY = 20_000
"""The third edge's --max-body-bytes: its item references read at most REFERENCED_BODIES times this."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("storage")) as running:
        running.worker(sim_ttft_ms=1, sim_itl_ms=1, max_num_seqs=64, max_model_len=CONTEXT)
        running.edge(auth="keys", storage_items=DEFAULT_ITEMS, storage_bytes=10_000_000)
        running.edge(auth="keys", storage_items=DEFAULT_ITEMS, storage_bytes=10_000_000,
                     response_ttl_s=SHORT_TTL_S)
        running.edge(auth="keys", storage_items=0, max_body_bytes=SMALL_BODY)
        yield running


async def sdk(stack: Stack, key: dict[str, Any], edge: int = 0) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=stack.edges[edge].url + "/v1", api_key=key["key"], max_retries=0) as client:
        yield client


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    """A key made without storage limits: the deployment's apply."""
    async for made in sdk(stack, create_key(stack, "--tenant", "plain")):
        yield made


async def ask(client: openai.AsyncOpenAI, text: Any = "hi", **extra: Any) -> Any:
    return await client.responses.create(model="fault-model", input=text, max_output_tokens=4, **extra)


async def test_a_key_made_without_limits_holds_the_deployments_items_and_a_delete_frees_one(
    stack: Stack, client: openai.AsyncOpenAI
) -> None:
    stored = [await ask(client) for _ in range(DEFAULT_ITEMS)]
    with pytest.raises(openai.RateLimitError) as caught:
        await ask(client)
    error = caught.value
    assert error.code == "storage_quota_exceeded" and error.body["param"] == "store"
    assert error.response.headers["x-should-retry"] == "false"  # the SDKs do not retry what waiting cannot fix
    assert (await ask(client, store=False)).output_text  # nothing stored: still served
    await client.responses.delete(stored[0].id)
    again = await ask(client)
    assert (await client.responses.retrieve(again.id)).output_text == again.output_text


async def test_only_a_key_made_unlimited_is_unlimited(stack: Stack) -> None:
    async for unlimited in sdk(stack, create_key(stack, "--tenant", "big", "--storage-items", "0")):
        await asyncio.gather(*(ask(unlimited) for _ in range(DEFAULT_ITEMS + 3)))


async def test_a_byte_quota_refuses_what_does_not_fit(stack: Stack) -> None:
    async for tight in sdk(stack, create_key(stack, "--tenant", "bytes", "--storage-bytes", "3000")):
        await ask(tight)  # a response object is ~1.2 kB
        with pytest.raises(openai.RateLimitError) as caught:
            await ask(tight, "word " * 400)
        assert caught.value.code == "storage_quota_exceeded"


async def test_a_resumable_stream_is_charged_its_request(stack: Stack) -> None:
    async for tight in sdk(stack, create_key(stack, "--tenant", "streams", "--storage-bytes", "3000",
                                             "--storage-items", "1")):
        resumable = {"Accept": "text/event-stream"}  # it asks for event ids, as EventSource clients do
        small = await tight.chat.completions.create(model="fault-model", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=2, stream=True, extra_headers=resumable)
        assert [chunk async for chunk in small]
        await ask(tight)  # a stream is not an item: the one stored response still fits
        big = [{"role": "user", "content": "word " * 400}]
        with pytest.raises(openai.RateLimitError) as caught:  # its 2 kB request is kept to be resumed: no room
            await tight.chat.completions.create(model="fault-model", messages=big, max_tokens=10, stream=True,
                                                extra_headers=resumable)
        assert caught.value.code == "storage_quota_exceeded"
        plain = await tight.chat.completions.create(model="fault-model", messages=big, max_tokens=10, stream=True)
        assert [chunk async for chunk in plain]  # a plain stream cannot be resumed: nothing kept, nothing charged
        answer = await tight.chat.completions.create(model="fault-model", messages=big, max_tokens=10)
        assert answer.choices[0].message.content  # not kept: not charged


async def test_a_resumable_streams_event_log_is_charged_once_it_ends(stack: Stack) -> None:
    async for tight in sdk(stack, create_key(stack, "--tenant", "logs", "--storage-bytes", "10000",
                                             "--storage-items", "0")):
        resumable = {"Accept": "text/event-stream"}
        long = await tight.completions.create(model="fault-model", prompt="x", max_tokens=500, stream=True,
                                              extra_headers=resumable)
        assert len([chunk async for chunk in long]) >= 500
        # its log (an entry per token, kept to be replayed) is charged by the worker once the job ended: more
        # than the 10 kB, so the next stream that would keep one is refused
        deadline = asyncio.get_running_loop().time() + 5
        while True:
            try:
                short = await tight.completions.create(model="fault-model", prompt="x", max_tokens=1, stream=True,
                                                       extra_headers=resumable)
                assert [chunk async for chunk in short]
            except openai.RateLimitError as exc:
                assert exc.code == "storage_quota_exceeded"
                break
            assert asyncio.get_running_loop().time() < deadline, "the log was never charged"
            await asyncio.sleep(0.05)
        plain = await tight.completions.create(model="fault-model", prompt="x", max_tokens=5, stream=True)
        assert [chunk async for chunk in plain]  # nothing kept: still served


async def test_an_answer_nobody_can_resume_is_not_kept_for_the_replay_window(
        stack: Stack, client: openai.AsyncOpenAI) -> None:
    """Every job's events go through a log in Redis: a resumable stream's is kept --replay-ttl-s after its end (5
    minutes) to be replayed; any other's (its answer, which nobody can read again) goes once its edge has read its
    end (with the edge's next heartbeat), not a minute later, streamed or not."""
    def logs() -> set[bytes]:
        return set(stack.client.scan_iter(keys.job_log("*")))

    before = logs()
    stream = await client.completions.create(model="fault-model", prompt="x", max_tokens=20, stream=True,
                                             extra_headers={"Accept": "text/event-stream"})
    assert [chunk async for chunk in stream]
    (resumable,) = logs() - before
    assert 240 < stack.client.ttl(resumable) <= 300
    before = logs()
    stream = await client.completions.create(model="fault-model", prompt="x", max_tokens=20, stream=True)
    assert [chunk async for chunk in stream]
    assert (await client.completions.create(model="fault-model", prompt="x", max_tokens=20)).choices[0].text
    deadline = time.monotonic() + 5  # the edges beat every 0.5 s here
    while logs() - before:
        assert time.monotonic() < deadline, logs() - before
        await asyncio.sleep(0.1)
    assert resumable in logs()


async def test_expired_responses_give_their_space_back(stack: Stack) -> None:
    async for short in sdk(stack, create_key(stack, "--tenant", "short"), edge=1):
        first = [await ask(short) for _ in range(DEFAULT_ITEMS)]
        with pytest.raises(openai.RateLimitError):
            await ask(short)
        await asyncio.sleep(SHORT_TTL_S + 0.2)
        with pytest.raises(openai.NotFoundError):
            await short.responses.retrieve(first[0].id)
        await ask(short)


async def test_a_long_conversation_fits_a_quota_that_copies_would_not(stack: Stack) -> None:
    """Each turn adds ~2 kB; 32 turns (past a whole copy at SNAPSHOT_EVERY) stored as copies of their history
    would take ~1 MB."""
    turns, said = 32, "word " * 400
    assert turns > SNAPSHOT_EVERY  # resolving crosses a whole copy
    async for chat in sdk(stack, create_key(stack, "--tenant", "chain", "--storage-bytes", "250000",
                                            "--storage-items", "0")):
        previous = None
        for _ in range(turns):
            response = await ask(chat, said, previous_response_id=previous)
            previous = response.id
        # the last turn saw every earlier one: each turn's 400 words and 4-token answer, and its own 400 words
        assert response.usage.input_tokens == (turns - 1) * 404 + 400
        await chat.responses.delete(previous)
        with pytest.raises(openai.RateLimitError):  # the quota holds: a copy of the whole history is ~100 kB
            for _ in range(3):
                await ask(chat, said * 30)


async def test_deleting_a_response_removes_its_turn_from_the_conversations_that_continue_it(stack: Stack) -> None:
    async for chat in sdk(stack, create_key(stack, "--tenant", "delete", "--storage-items", "0")):
        first = await ask(chat, "one")
        second = await ask(chat, "two", previous_response_id=first.id)
        third = await ask(chat, "three", previous_response_id=second.id)
        await chat.responses.delete(second.id)
        assert (await chat.responses.retrieve(third.id)).output_text == third.output_text
        with pytest.raises(openai.BadRequestError) as caught:
            await ask(chat, "four", previous_response_id=third.id)
        assert (caught.value.code, caught.value.param) == ("previous_response_not_found", "previous_response_id")
        assert (await ask(chat, "again", previous_response_id=first.id)).usage.input_tokens == 1 + 4 + 1


async def test_the_history_stored_is_the_one_truncation_ran(stack: Stack) -> None:
    turns = [{"role": "user", "content": "old " * 60_000}, {"role": "assistant", "content": "said " * 30_000},
             {"role": "user", "content": "now"}]
    async for chat in sdk(stack, create_key(stack, "--tenant", "truncated")):
        cut = await ask(chat, turns, truncation="auto", instructions="be brief")
        assert cut.usage.input_tokens == 2 + 30_000 + 1  # the oldest turn left out
        follow = await ask(chat, "next", previous_response_id=cut.id)
        assert follow.usage.input_tokens == 30_000 + 1 + 4 + 1  # and left out of what was stored


async def test_the_edge_reports_redis_memory_against_its_maxmemory(stack: Stack) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(stack.edges[0].metrics_url)).text
    assert metric_value(text, "tokenbus_edge_redis_maxmemory_bytes") == REDIS_MAXMEMORY_BYTES
    assert 0 < metric_value(text, "tokenbus_edge_redis_used_memory_bytes") < REDIS_MAXMEMORY_BYTES


async def test_item_references_read_only_the_callers_own_items_and_a_bounded_amount(stack: Stack) -> None:
    """An item reference, in a response's input or in items added to a conversation, finds only its tenant's
    stored items; an id no response of this server made, or none at all, is a 400 naming it; and what the
    responses referenced come to is bounded before any is read."""
    async for mine in sdk(stack, create_key(stack, "--tenant", "refs-a"), edge=2):
        first = await ask(mine, "remember this")
        ref = {"type": "item_reference", "id": first.output[0].id}
        assert (await ask(mine, [ref, {"role": "user", "content": "again"}])).output_text
        conversation = await mine.conversations.create(items=[ref])  # type: ignore[list-item]
        kept = (await mine.conversations.items.list(conversation.id)).data
        assert [(item.id, item.content[0].text) for item in kept] == [
            (first.output[0].id, first.output_text)]
        async for theirs in sdk(stack, create_key(stack, "--tenant", "refs-b"), edge=2):
            with pytest.raises(openai.BadRequestError) as caught:
                await ask(theirs, [ref])
            assert caught.value.body["param"] == "input[0].id" and "not found" in caught.value.message
            own = await theirs.conversations.create()
            for call in (theirs.conversations.create(items=[ref]),  # type: ignore[list-item]
                         theirs.conversations.items.create(own.id, items=[ref])):  # type: ignore[list-item]
                with pytest.raises(openai.BadRequestError) as caught:
                    await call
                assert caught.value.body["param"] == "items[0].id" and "not found" in caught.value.message
            assert not (await theirs.conversations.items.list(own.id)).data
        for bad, param in (({"type": "item_reference", "id": "msg_mine"}, "input[0].id"),
                           ({"type": "item_reference"}, "input[0].id")):
            with pytest.raises(openai.BadRequestError) as refused:
                await ask(mine, [bad])
            assert refused.value.body["param"] == param
        big = [await ask(mine, "word " * (SMALL_BODY // 6)) for _ in range(REFERENCED_BODIES * 2)]
        many = [{"type": "item_reference", "id": response.output[0].id} for response in big]
        assert (await ask(mine, many[:2])).output_text  # two such responses are well within the bound
        with pytest.raises(openai.BadRequestError) as bounded:
            await ask(mine, many)
        assert bounded.value.body["param"] == "input" and "at most" in bounded.value.message
        with pytest.raises(openai.BadRequestError) as bounded:
            await mine.conversations.items.create(conversation.id, items=many)
        assert bounded.value.body["param"] == "items" and "references come to" in bounded.value.message


async def test_items_added_to_a_conversation_are_referenced_by_their_tenant_alone(stack: Stack) -> None:
    """An item the Conversations API added (its id names its conversation) reads as itself in a response's input
    and in items added to another conversation, for its tenant alone; gone with its conversation, it is a 400 as an
    item that never was; and items of more than REFERENCED_BODIES conversations are refused before any is read."""
    async for mine in sdk(stack, create_key(stack, "--tenant", "conv-refs-a"), edge=2):
        noted = await mine.conversations.create(items=[
            {"type": "message", "role": "user", "content": "the word is tangerine"}])
        item = (await mine.conversations.items.list(noted.id)).data[0]
        assert item.id.startswith("msg_conv")
        ref = {"type": "item_reference", "id": item.id}
        ran = await ask(mine, [ref, {"role": "user", "content": "again"}])
        read = [listed async for listed in mine.responses.input_items.list(ran.id, order="asc")]
        assert [(listed.id, listed.content[0].text) for listed in read] == [
            (item.id, "the word is tangerine"), (read[1].id, "again")]
        copied = await mine.conversations.create(items=[ref])  # type: ignore[list-item]
        assert [(kept.id, kept.content[0].text) for kept in (
            await mine.conversations.items.list(copied.id)).data] == [(item.id, "the word is tangerine")]
        async for theirs in sdk(stack, create_key(stack, "--tenant", "conv-refs-b"), edge=2):
            with pytest.raises(openai.BadRequestError) as caught:
                await ask(theirs, [ref])
            assert caught.value.body["param"] == "input[0].id" and "not found" in caught.value.message
        others = [await mine.conversations.create(items=[{"type": "message", "role": "user", "content": "x"}])
                  for _ in range(REFERENCED_BODIES)]
        many = [ref] + [{"type": "item_reference", "id": (await mine.conversations.items.list(other.id)).data[0].id}
                        for other in others]
        with pytest.raises(openai.BadRequestError) as bounded:
            await ask(mine, many)
        assert bounded.value.body["param"] == "input" and "conversations" in bounded.value.message
        assert (await ask(mine, many[:REFERENCED_BODIES])).output_text
        await mine.conversations.delete(noted.id)
        with pytest.raises(openai.BadRequestError) as gone:
            await ask(mine, [ref])
        assert gone.value.body["param"] == "input[0].id"
