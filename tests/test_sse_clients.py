"""Streams as hand-written SSE clients read them: vLLM's own benchmark client (`vllm bench serve`) parses
each event as `data: ` + JSON, so an event id is only sent to clients that ask for server-sent events."""

from __future__ import annotations

import aiohttp
import httpx
import pytest

from tests.processes import MODEL, Edge


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_vllm_bench_serve_reads_every_token_of_a_stream(served: Edge, endpoint: str) -> None:
    from vllm.benchmarks.lib import endpoint_request_func as vllm_client

    request = vllm_client.RequestFuncInput(prompt="Count to ten:", api_url=served.url + endpoint, prompt_len=4,
                                           output_len=12, model=MODEL, ignore_eos=True)
    send = (vllm_client.async_request_openai_completions if endpoint == "/v1/completions"
            else vllm_client.async_request_openai_chat_completions)
    async with aiohttp.ClientSession() as session:
        result = await send(request, session)
    assert result.success, result.error
    assert result.output_tokens == 12 and result.generated_text
    assert len(result.itl) >= 1 and result.ttft > 0


async def test_events_carry_ids_for_clients_that_ask_for_server_sent_events(served: Edge) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        plain = (await http.post(served.url + "/v1/completions", json=body)).text
        sse = (await http.post(served.url + "/v1/completions", json=body,
                               headers={"Accept": "text/event-stream"})).text
    assert not [line for line in plain.splitlines() if line.startswith("id:")]
    assert all(event.startswith("data: ") for event in plain.strip().split("\n\n"))
    ids = [line[4:] for line in sse.splitlines() if line.startswith("id: ")]
    events = sse.strip().split("\n\n")
    assert len(ids) == len(events) and ids[-1].endswith(f":{len(events) - 1}")  # every event, numbered from 0
