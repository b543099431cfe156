"""The bus-less reference for `tokenbus bench edge`: the same simulated engine inside a bare aiohttp handler,
streaming chat chunks straight from the engine to the client. No Redis, no worker, no validation beyond reading
the JSON: a benchmarking tool, never a server. What the load generator measures against it is the floor of this
machine (its HTTP client, aiohttp, loopback TCP, the simulator's timer grain); what tokenbus measures above it is
what the edge and the bus add.

Run: python -m services.bench.bare PORT TTFT_MS ITL_MS
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import orjson
from aiohttp import web

from services.worker.sim import SimEngine
from shared.protocol import bus
from shared.runtime import eventloop
from shared.runtime.settings import Settings

MODEL = "bare"


def _chunk(job_id: str, created: int, delta: dict[str, str], finish: str | None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": job_id, "object": "chat.completion.chunk", "created": created, "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    engine: SimEngine = request.app["engine"]
    job = bus.Job(id=uuid.uuid4().hex, model=MODEL, reply_to="", deadline_ms=bus.now_ms() + 600_000,
                  messages=[bus.Message(role="user", content=m["content"]) for m in body["messages"]],
                  params=bus.SamplingParams(max_tokens=body.get("max_tokens")))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    created, first = int(time.time()), True
    events: asyncio.Queue[bus.Output | None] = asyncio.Queue()
    running = asyncio.create_task(engine.run_into(job, 0, events.put_nowait))
    running.add_done_callback(lambda _running: events.put_nowait(None))
    while (event := await events.get()) is not None:
        if isinstance(event, bus.Tokens):
            delta = {"role": "assistant", "content": event.text} if first else {"content": event.text}
            await response.write(_chunk(job.id, created, delta, event.finish_reason))
            first = False
        elif isinstance(event, bus.Final):
            usage = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                     "total_tokens": event.prompt_tokens + event.completion_tokens}
            await response.write(b"data: " + orjson.dumps({"id": job.id, "object": "chat.completion.chunk",
                                                           "choices": [], "usage": usage}) + b"\n\n")
    await running
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def ready(_request: web.Request) -> web.Response:
    return web.json_response({"models": [MODEL]})


def app(ttft_ms: float, itl_ms: float) -> web.Application:
    application = web.Application()
    application["engine"] = SimEngine(Settings(model=MODEL, engine="sim", sim_ttft_ms=ttft_ms, sim_itl_ms=itl_ms,
                                               max_num_seqs=100_000))
    application.router.add_post("/v1/chat/completions", chat)
    application.router.add_get("/ready", ready)
    return application


async def serve(port: int, ttft_ms: float, itl_ms: float) -> None:
    runner = web.AppRunner(app(ttft_ms, itl_ms), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()  # until the harness stops the process


def main() -> None:
    port, ttft_ms, itl_ms = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    eventloop.run(serve(port, ttft_ms, itl_ms), Settings().event_loop)  # the edge's loop, for a fair floor


if __name__ == "__main__":
    main()
