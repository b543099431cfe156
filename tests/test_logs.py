"""Request ids and structured logs, with real processes: x-request-id is returned (ours when the client's is
not a sane one), JSON log lines name the request they are about, and no log holds a prompt, a completion or
a key."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.stack import Stack

SECRET_PROMPT = "the-launch-code-is-4711"


async def test_request_ids_are_returned_and_logged_and_nothing_secret_is(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        edge = stack.edge(log_format="json", log_level="DEBUG", resume_window_s=0, auth="keys")
        worker = stack.worker(log_format="json", log_level="DEBUG")
        import redis.asyncio as aioredis

        from services.admin import run as _unused  # noqa: F401  (the keys command is what operators use)
        from shared.tenancy import apikeys

        client = aioredis.Redis.from_url(stack.url)
        key, _record = await apikeys.create(client, apikeys.KeyChanges(tenant="logged"))
        await client.aclose()
        body = {"model": stack.model, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 500,
                "stream": True}
        headers = {"Authorization": f"Bearer {key}", "x-request-id": "req-abc.123"}
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", edge.url + "/v1/chat/completions", json=body, headers=headers) as cut:
                assert cut.headers["x-request-id"] == "req-abc.123"
                async for line in cut.aiter_lines():
                    if line.startswith("data:"):
                        break  # the client leaves: the worker aborts the job and says so
            ours = await http.get(edge.url + "/v1/models", headers={"Authorization": f"Bearer {key}",
                                                                     "x-request-id": "no spaces allowed"})
        assert ours.headers["x-request-id"] != "no spaces allowed" and len(ours.headers["x-request-id"]) == 32
        deadline = time.monotonic() + 10
        while "req-abc.123" not in worker.log.read_text():
            assert time.monotonic() < deadline, worker.log.read_text()[-2000:]
            await asyncio.sleep(0.2)
        records = [json.loads(line) for line in worker.log.read_text().splitlines() if line.startswith("{")]
        about = [r for r in records if r.get("request_id") == "req-abc.123"]
        assert about and all({"ts", "level", "role", "logger", "message"} <= r.keys() for r in about)
        assert any("aborted" in r["message"] for r in about)
        for log in (edge.log, worker.log):
            text = log.read_text()
            assert SECRET_PROMPT not in text and key not in text
            assert " t1 t2" not in text  # the simulated completion
    finally:
        stack.close()
