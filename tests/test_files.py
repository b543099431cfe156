"""The Files API, driven by the official openai SDK against a real edge and Redis: batch input files checked on
upload, kept per tenant within its storage, read back byte for byte, listed and deleted."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from shared.protocol import keys
from tests.stack import Stack


def _batch(lines: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}}) + "\n"
                   for i in range(lines)).encode()


async def test_a_batch_file_is_checked_kept_listed_read_back_and_deleted(stack: Stack) -> None:
    edge, other_edge = stack.edge(), stack.edge()
    data = _batch(1000)
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client, \
            openai.AsyncOpenAI(base_url=other_edge.url + "/v1", api_key="unused", max_retries=0) as other:
        uploaded = await client.files.create(file=("requests.jsonl", data), purpose="batch")
        assert (uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.status) == (
            len(data), "requests.jsonl", "batch", "processed")
        assert uploaded.id.startswith("file-") and uploaded.expires_at and uploaded.expires_at > uploaded.created_at
        assert (await other.files.retrieve(uploaded.id)).bytes == len(data)
        assert (await other.files.content(uploaded.id)).content == data  # any edge, byte for byte
        notes = await client.files.create(file=("notes.txt", b"anything at all"), purpose="user_data")
        listed = [f.id async for f in other.files.list()]
        assert listed == [notes.id, uploaded.id]  # newest first
        assert [f.id async for f in other.files.list(purpose="batch")] == [uploaded.id]
        for bad, why in ((b"not json\n", "Line 1"), (_batch(2) + _batch(1), "used twice"),
                         (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/images", "body": {}}).encode(),
                          "`url`"), (b"\n\n", "no requests"),
                         (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": [1]}',
                          "`body` is not an object"),
                         (b'{"custom_id": "\xff", "method": "POST", "url": "/v1/completions", "body": {}}', "UTF-8"),
                         (b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": {"x": '
                          + b"[" * 50_000 + b"]" * 50_000 + b"}}", "nested too deeply")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.files.create(file=("bad.jsonl", bad), purpose="batch")
            assert refused.value.body["param"] == "file" and why in refused.value.body["message"]
        async with httpx.AsyncClient(base_url=edge.url) as http:
            for listing in ("/v1/files", "/v1/batches"):  # a number too long to convert, one above the bound
                for limit in ("0001" + "0" * 5000, "000" + "1" * 6, "0"):
                    listed_badly = await http.get(listing, params={"limit": limit})
                    assert listed_badly.status_code == 400 and listed_badly.json()["error"]["param"] == "limit"
            assert (await http.get("/v1/batches", params={"limit": "0007"})).status_code == 200
        with pytest.raises(openai.BadRequestError) as wrong:
            await client.files.create(file=("x.jsonl", data), purpose="fine-tune")
        assert wrong.value.body["param"] == "purpose"
        deleted = await other.files.delete(uploaded.id)
        assert deleted.deleted and deleted.id == uploaded.id
        for call in (client.files.retrieve(uploaded.id), client.files.content(uploaded.id),
                     client.files.delete(uploaded.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        # without keys, a form a web page could post is refused: an upload needs the Authorization header the
        # SDKs send (which a page cannot add without a CORS preflight)
        async with httpx.AsyncClient() as http:
            forged = await http.post(edge.url + "/v1/files", data={"purpose": "batch"},
                                     files={"file": ("x.jsonl", data)})
        assert forged.status_code == 415
    assert stack.client.hget(keys.storage_tally(""), f"f:{uploaded.id}") is None  # its bytes were given back
    assert not stack.client.exists(keys.file_chunks("", uploaded.id))



async def test_expired_files_and_batches_leave_their_tenants_index(stack: Stack) -> None:
    """A tenant's index of its files and of its batches holds what may still be there: each new file or batch
    takes out those made longer ago than they live (the indexes kept every file and batch a tenant ever made)."""
    edge = stack.edge(response_ttl_s=1)
    days_ago = (time.time() - 3 * 24 * 3600) * 1000  # a batch lives its 24 h window, then the answers' ttl
    stack.client.zadd(keys.batches(""), {"batch_made_days_ago": days_ago})
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        for _ in range(3):
            await client.files.create(file=("requests.jsonl", _batch(1)), purpose="batch")
        assert stack.client.zcard(keys.files("")) == 3
        await asyncio.sleep(1.5)  # the files expired
        last = await client.files.create(file=("requests.jsonl", _batch(1)), purpose="batch")
        assert stack.client.zrange(keys.files(""), 0, -1) == [last.id.encode()]
        batch = await client.batches.create(input_file_id=last.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
    assert stack.client.zrange(keys.batches(""), 0, -1) == [batch.id.encode()]
