"""/ready means every model the deployment serves has come up (real processes, simulated engines)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.supervisor import free_port
from tests.processes import ROOT, stop_process
from tests.stack import Stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with Stack(tmp_path, model="chat-model") as running:
        yield running


async def test_ready_waits_for_every_configured_model_and_stays_ready_when_one_restarts(stack: Stack) -> None:
    """An edge is ready once every model has come up. Later, one model's workers all gone (a restart of the
    embedder) must not take the chat model's traffic down with it: the edge stays ready, serves chat, and answers
    the missing model with a 503 SDKs retry."""
    edge = stack.edge(ready_models="chat-model,embed-model")
    stack.worker()
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as http:
        deadline = time.monotonic() + 10
        while (one := await http.get("/ready", params={"model": "chat-model"})).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        waiting = await http.get("/ready")
        assert waiting.status_code == 503 and waiting.json()["waiting_for_models"] == 1
        assert "chat-model" not in waiting.text and "embed-model" not in waiting.text  # no key needed: no names
        stack.model = "embed-model"
        embedder = stack.worker()
        while (await http.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline + 10
            await asyncio.sleep(0.2)
        assert (await http.get("/ready", params={"model": "nope"})).status_code == 503
        stop_process(embedder.process)
        while (await http.get("/ready", params={"model": "embed-model"})).status_code == 200:
            assert time.monotonic() < deadline + 30
            await asyncio.sleep(0.2)
        assert (await http.get("/ready")).status_code == 200
        chat = await http.post("/v1/chat/completions", json={
            "model": "chat-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        embedding = await http.post("/v1/embeddings", json={"model": "embed-model", "input": "Hi"})
    assert one.json() == {"status": "ready"}
    assert chat.status_code == 200
    assert embedding.status_code == 503 and embedding.headers["Retry-After"]
    assert embedding.json()["error"]["code"] == "model_unavailable"


@contextlib.contextmanager
def tokenbus_run(tmp_path: Path, **env: str) -> Iterator[tuple[str, Path, int]]:
    """`tokenbus run` (what `make run` starts) on simulated engines, with `env` besides, once it says it is ready:
    its URL, its log and its first metrics port."""
    port, metrics = free_port(), _free_ports_in_a_row(3)
    env = {**os.environ, "TOKENBUS_CACHE_DIR": str(tmp_path), "TOKENBUS_ENGINE": "sim", "TOKENBUS_PORT": str(port),
           "TOKENBUS_METRICS_PORT": str(metrics), **env}
    env.pop("TOKENBUS_REDIS_URL", None)
    env.pop("TOKENBUS_AUTH", None)
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "services.cli", "run"], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "ready: http" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", log, metrics
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def test_tokenbus_run_says_ready_only_once_it_serves_every_model_and_needs_no_key(tmp_path: Path) -> None:
    """`tokenbus run` (what `make run` starts), on simulated engines: its "ready" line comes once /ready is
    200 for the chat and the embedding model, and the README's first request works without a key."""
    with tokenbus_run(tmp_path) as (url, log, metrics):
        ready = httpx.get(url + "/ready", timeout=5)
        chat = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert ready.status_code == 200
        assert chat.status_code == 200
        assert "without API keys" in log.read_text()
        assert "private redis-server at unix://" in log.read_text()  # its processes share the machine
        # the edge's metrics on --metrics-port, the worker's and the embedder's on the next two; none on the API's
        texts = [httpx.get(f"http://127.0.0.1:{metrics + i}/metrics", timeout=5).text for i in range(3)]
        assert "tokenbus_edge_ready 1.0" in texts[0]
        assert 'model="SmolLM2-135M-Instruct"' in texts[1] and 'model="all-MiniLM-L6-v2"' in texts[2]
        assert httpx.get(url + "/metrics", timeout=5).status_code == 404


def test_tokenbus_run_starts_a_worker_whose_engine_died_again_and_its_stream_goes_on(tmp_path: Path) -> None:
    """The chat model's engine dies 50 tokens into a 60-token stream: its worker hands the job over and exits 1,
    `tokenbus run` starts it again, and the new worker finishes the stream; the client sees no seam."""
    with tokenbus_run(tmp_path, TOKENBUS_SIM_DIES_AFTER_TOKENS="50") as (url, log, _metrics):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=60, stream=True,
                                                    messages=[{"role": "user", "content": "count"}])
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == "".join(f" t{n}" for n in range(1, 61))
        assert "the engine died" in log.read_text() and "starting it again (1 of 3)" in log.read_text()
        assert httpx.get(url + "/ready", timeout=5).status_code == 200


def _free_ports_in_a_row(count: int) -> int:
    """The first of `count` consecutive free loopback ports."""
    import socket
    from contextlib import ExitStack

    while True:
        first = free_port()
        with ExitStack() as held:
            try:
                for port in range(first, first + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
