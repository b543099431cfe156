"""Edges upgraded before their workers (a rolling upgrade): a job that needs what an older worker would ignore is
refused with a 503 to retry while any worker of its model is older, never answered wrongly; real processes (a
Redis, an edge, a simulated worker) and the heartbeat an older worker writes (no `features`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from shared.protocol import keys
from tests.stack import Stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(tmp_path) as running:
        yield running


def older_worker_beats(stack: Stack, ttl_s: float = 60) -> str:
    """The heartbeat of a worker of the previous version: what it serves, and none of the newer features."""
    key = keys.worker_heartbeat(stack.model, "older-1")
    info = {"worker": "older-1", "model": stack.model, "task": "generate", "max_model_len": 4096, "slots": 8}
    stack.client.set(key, msgspec.json.encode(info), px=int(ttl_s * 1000))
    stack.client.zadd(keys.WORKERS, {key: time.time() + ttl_s})
    return key


async def test_token_ids_and_tokenize_wait_for_every_worker_of_the_model_to_take_them(stack: Stack) -> None:
    edge = stack.edge()
    stack.worker()
    older = older_worker_beats(stack)
    asks = [("/v1/completions", {"model": stack.model, "prompt": [1, 2, 3], "max_tokens": 2}),
            ("/tokenize", {"model": stack.model, "prompt": "one two"}),
            ("/tokenize", {"inputs": "one two"}),
            ("/detokenize", {"model": stack.model, "tokens": [1, 2]})]
    async with httpx.AsyncClient(base_url=edge.url, timeout=10) as http:
        await asyncio.sleep(2.5)  # the edge's directory has read the older worker's heartbeat
        for path, body in asks:
            refused = await http.post(path, json=body)
            assert refused.status_code == 503 and refused.headers["Retry-After"], (path, refused.text)
            assert refused.json()["error"]["code"] == "model_unavailable"
        text = await http.post("/v1/completions", json={"model": stack.model, "prompt": "one two", "max_tokens": 2})
        assert text.status_code == 200  # what every version serves is served meanwhile
        stack.client.delete(older)  # the last older worker is gone: upgraded
        stack.client.zrem(keys.WORKERS, older)
        deadline = time.monotonic() + 10
        while (await http.post(*asks[0][:1], json=asks[0][1])).status_code != 200:
            assert time.monotonic() < deadline, "token ids still refused with every worker upgraded"
            await asyncio.sleep(0.2)
        for path, body in asks[1:]:
            assert (await http.post(path, json=body)).status_code == 200, path
    await stack.settled()
