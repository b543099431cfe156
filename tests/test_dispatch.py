"""Cache-aware dispatch with real processes (edges, simulated workers, a real Redis): a job goes to the worker that
holds its prompt's prefix while it has room, waits for a busy one only up to the bound, and a killed holder's jobs,
read or not, continue on another worker with nothing lost or repeated."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import httpx
import msgspec
import openai

from shared.protocol import bus, keys, prefixes
from shared.tenancy.adapters import Adapter
from tests.processes import WorkerProcess, metric_value
from tests.stack import Stack

SYSTEM = "You answer in the house style. " * 40
"""A long system prompt many requests share."""


def messages(question: str) -> list[bus.Message]:
    return [bus.Message(role="system", content=SYSTEM), bus.Message(role="user", content=question)]


def links(question: str, model: str) -> list[str]:
    return prefixes.chain(bus.Job(id="j", model=model, reply_to="", deadline_ms=0, messages=messages(question)))


def expected(tokens: int) -> str:
    return "".join(f" t{n}" for n in range(1, tokens + 1))


async def ask(url: str, model: str, question: str, tokens: int) -> tuple[str, float]:
    """A streamed chat through the openai SDK: its text, and the seconds to its first token."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        sent = time.monotonic()
        stream = await client.chat.completions.create(model=model, max_tokens=tokens, stream=True, messages=[
            {"role": m.role, "content": m.content} for m in messages(question)])  # type: ignore[misc]
        text, first = "", 0.0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic() - sent
                text += chunk.choices[0].delta.content
        return text, first


def worker_id(stack: Stack, worker: WorkerProcess) -> str:
    found = [key.decode().rsplit(":", 1)[1] for key in stack.client.scan_iter(keys.worker_heartbeat(stack.model, "*"))
             if f"-{worker.process.pid}-" in key.decode()]
    assert len(found) == 1, found
    return found[0]


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


async def holds(stack: Stack, worker: WorkerProcess, question: str) -> None:
    """Waits until the worker's prefix set (written with its heartbeat) holds the question's whole chain."""
    key = keys.prefixes(stack.model, worker_id(stack, worker))
    chain = links(question, stack.model)
    await until(lambda: all(stack.client.smismember(key, chain)))


async def decisions(stack: Stack) -> dict[str, float]:
    """The placements of the stack's jobs by reason, summed over its edges and live workers: whichever of them
    dispatches a job (an edge as it enqueues or at a wait's bound, a worker as a job ends or it beats) counts it."""
    places = [edge.metrics_url for edge in stack.edges]
    places += [worker.metrics_url for worker in stack.workers if worker.process.poll() is None]
    seen = dict.fromkeys(("cache", "waited", "expired", "none"), 0.0)
    async with httpx.AsyncClient() as http:
        for place in places:
            text = (await http.get(place)).text
            for reason in seen:
                seen[reason] += metric_value(text, "tokenbus_dispatch_decisions_total",
                                             {"model": stack.model, "reason": reason})
    return seen


async def test_jobs_go_to_the_worker_that_holds_their_prefix(stack: Stack) -> None:
    """The first request of a system prompt goes to either worker; the next six, sharing its system prompt, all to
    that one (the prefix cache counters show it: the other prefilled nothing), while it has room."""
    edge = stack.edge()
    first = stack.worker(sim_prefix_cache_blocks=1000)
    await ask(edge.url, stack.model, "warm up", 1)
    await holds(stack, first, "warm up")
    second = stack.worker(sim_prefix_cache_blocks=1000)
    answers = await asyncio.gather(*(ask(edge.url, stack.model, f"question {i}", 5) for i in range(6)))
    assert [text for text, _ in answers] == [expected(5)] * 6
    assert (await decisions(stack))["cache"] == 6
    async with httpx.AsyncClient() as http:
        for worker, asked in ((first, 7), (second, 0)):
            text = (await http.get(worker.metrics_url)).text
            queries = metric_value(text, "tokenbus_worker_prefix_cache_queries_total", {"model": stack.model})
            assert (queries > 0) == (asked > 0), (worker.metrics_url, queries)
    await stack.settled()


async def test_a_new_prefix_goes_to_one_worker_and_different_ones_spread(stack: Stack) -> None:
    """Six requests of a system prompt nobody ran yet, sent at once, before any worker says it holds it: all go to
    one worker (the prefix's place in its rendezvous order), not wherever a read was waiting; sixteen different
    prompts after them spread over both workers."""
    edge = stack.edge()
    workers = [stack.worker(sim_prefix_cache_blocks=1000), stack.worker(sim_prefix_cache_blocks=1000)]
    answers = await asyncio.gather(*(ask(edge.url, stack.model, f"question {i}", 5) for i in range(6)))
    assert [text for text, _ in answers] == [expected(5)] * 6
    async with httpx.AsyncClient() as http:

        async def queried() -> list[float]:
            return [metric_value((await http.get(worker.metrics_url)).text,
                                 "tokenbus_worker_prefix_cache_queries_total", {"model": stack.model})
                    for worker in workers]

        assert sorted(q > 0 for q in await queried()) == [False, True]
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
            for n in range(16):
                await client.chat.completions.create(model=stack.model, max_tokens=1, messages=[
                    {"role": "system", "content": f"{n} " * 600}, {"role": "user", "content": "hi"}])
        assert all(q > 0 for q in await queried())
    await stack.settled()


async def test_a_prompt_nobody_holds_goes_to_the_worker_with_the_most_free_slots(stack: Stack) -> None:
    """Of two workers with four slots, one runs three long answers of one system prompt (they follow the first to its
    worker): eight prompts nobody holds, one after the other, all go to the other worker, which has more slots free
    (a hash of each prompt would have put about half of them on the busy one)."""
    edge = stack.edge()
    workers = [stack.worker(max_num_seqs=4, sim_prefix_cache_blocks=1000) for _ in range(2)]
    long = [asyncio.create_task(ask(edge.url, stack.model, f"long {i}", 150)) for i in range(3)]  # 3 s each
    async with httpx.AsyncClient() as http:

        async def queried() -> list[float]:
            return [metric_value((await http.get(worker.metrics_url)).text,
                                 "tokenbus_worker_prefix_cache_queries_total", {"model": stack.model})
                    for worker in workers]

        await until(lambda: stack.pending() == 3)
        before = await queried()
        assert sorted(q > 0 for q in before) == [False, True], before  # all three on one worker
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
            for n in range(8):
                await client.chat.completions.create(model=stack.model, max_tokens=1, messages=[
                    {"role": "system", "content": f"{n} " * 600}, {"role": "user", "content": "hi"}])
        after = await queried()
    assert not all(task.done() for task in long)
    busy = before.index(max(before))
    assert after[busy] == before[busy] and after[1 - busy] > 0, (before, after)
    assert [text for text, _ in await asyncio.gather(*long)] == [expected(150)] * 3
    await stack.settled()


async def test_a_job_waits_for_a_busy_holder_no_longer_than_the_bound(stack: Stack) -> None:
    """The holder has one slot, taken by a long answer: a job sharing its prefix waits for it 1 s (the bound), then
    the other worker serves it, well before the holder would have been free (4 s)."""
    edge = stack.edge(affinity_wait_ms=1000)
    holder = stack.worker(max_num_seqs=1)
    await ask(edge.url, stack.model, "warm up", 1)
    await holds(stack, holder, "warm up")
    stack.worker(max_num_seqs=1)
    long = asyncio.create_task(ask(edge.url, stack.model, "a long answer", 200))  # 4 s at 20 ms a token
    await until(lambda: stack.pending() == 1)
    text, first = await ask(edge.url, stack.model, "a short one", 3)
    assert text == expected(3)
    assert 0.9 < first < 1.6, first  # the bound, then a hop (the edge dispatches at the bound's end)
    assert not long.done()
    seen = await decisions(stack)
    assert (seen["cache"], seen["expired"]) == (1, 1), seen  # the long one on the holder; the short one past it
    assert (await long)[0] == expected(200)
    await stack.settled()


async def test_a_killed_holder_s_jobs_read_or_not_continue_elsewhere(stack: Stack) -> None:
    """Two answers run on the holder and a third waits unread on its own stream (it froze first); kill -9 of the
    holder: the other worker continues the two from their logs and starts the third, each client gets every token
    once, nothing stays pending and the dead worker's stream goes."""
    edge = stack.edge()
    holder = stack.worker()
    await ask(edge.url, stack.model, "warm up", 1)
    await holds(stack, holder, "warm up")
    own = keys.worker_requests(stack.model, worker_id(stack, holder))
    stack.worker()
    running = [asyncio.create_task(ask(edge.url, stack.model, f"running {i}", 100)) for i in range(2)]
    await until(lambda: stack.client.xlen(own) == 2)
    await asyncio.sleep(0.5)  # tokens flow
    os.killpg(holder.process.pid, signal.SIGSTOP)
    unread = asyncio.create_task(ask(edge.url, stack.model, "unread", 20))
    await until(lambda: stack.client.xlen(own) == 3, timeout_s=1.0)  # its offer still stands: it is placed there
    stack.kill(holder.process)
    results = await asyncio.wait_for(asyncio.gather(*running, unread), 30)
    assert [text for text, _ in results] == [expected(100), expected(100), expected(20)]
    await stack.settled()
    await until(lambda: not stack.client.exists(own))


async def test_a_worker_whose_own_stream_is_removed_under_its_read_makes_it_again_and_serves_on(
        stack: Stack) -> None:
    """Another worker's rescue removes the own stream of a worker it takes for stopped (its offer lapsed while its
    loop was held up, as on a loaded host), while that worker's read waits on it: the worker makes its stream
    again and goes on serving, rather than dying of the read's error."""
    edge = stack.edge()
    worker = stack.worker()
    await ask(edge.url, stack.model, "warm up", 1)  # its read now blocks on both streams
    own = keys.worker_requests(stack.model, worker_id(stack, worker))
    await asyncio.sleep(0.3)
    assert stack.client.delete(own) == 1
    await until(lambda: stack.client.exists(own) == 1, timeout_s=5.0)  # made again, with the workers' group
    assert worker.process.poll() is None
    assert (await ask(edge.url, stack.model, "after", 5))[0] == expected(5)
    assert worker.process.poll() is None
    await stack.settled()


def test_a_prompt_cache_key_heads_the_chain_of_its_tenant_only() -> None:
    def chain(text: str, key: str = "", tenant: str = "t") -> list[str]:
        return prefixes.chain(bus.Job(id="j", model="m", reply_to="", deadline_ms=0, tenant=tenant, cache_key=key,
                                      messages=[bus.Message(role="user", content=text)]))

    assert chain("one", "k")[0] == chain("two", "k")[0] != chain("one")[0]  # the key, whatever follows
    assert chain("one", "k", tenant="other")[0] != chain("one", "k")[0]  # another tenant's key is another head
    long = "x" * 5000  # a long message: a link per 1 KiB piece, then one at its end
    assert chain(long + "a")[:4] == chain(long + "b")[:4] and chain(long + "a")[4] != chain(long + "b")[4]


def test_salted_jobs_share_no_link_with_another_salt_s() -> None:
    """The prompt cache kept per tenant: dispatch sees no common prefix between tenants (their engines' caches hold
    none), and a tenant's jobs share theirs."""
    def chain(text: str, salt: str = "") -> list[str]:
        return prefixes.chain(bus.Job(id="j", model="m", reply_to="", deadline_ms=0, cache_salt=salt,
                                      messages=[bus.Message(role="user", content=text)]))

    long = "x" * 3000
    assert not set(chain(long, "a")) & set(chain(long, "b")) and not set(chain(long, "a")) & set(chain(long))
    assert chain(long + "1", "a")[:2] == chain(long + "2", "a")[:2]  # its first two 1 KiB pieces
    # the salt names no text: a tenant's unrelated prompts share no link (or dispatch would send them all where one
    # ran), and a prompt with no link unsalted has none salted
    assert not set(chain("What is 2 + 2?", "a")) & set(chain("Translate hello", "a"))
    assert prefixes.chain(bus.Job(id="j", model="m", reply_to="", deadline_ms=0, kind="embedding", prompts=["x"],
                                  cache_salt="a")) == []


def test_an_adapter_heads_its_jobs_chains_apart_from_its_base_model() -> None:
    """An engine caches an adapter's prompts apart from its base model's: no link of one is the other's, and an
    adapter's jobs share their first link (they go where it is loaded)."""
    def chain(text: str, adapter: str = "") -> list[str]:
        return prefixes.chain(bus.Job(id="j", model="m", reply_to="", deadline_ms=0, adapter=adapter,
                                      messages=[bus.Message(role="user", content=text)]))

    assert chain("one", "a")[0] == chain("two", "a")[0]
    assert not set(chain("one", "a")) & set(chain("one")) and not set(chain("one", "a")) & set(chain("one", "b"))


def heartbeat(stack: Stack, worker: WorkerProcess) -> bus.WorkerInfo:
    raw = stack.client.get(keys.worker_heartbeat(stack.model, worker_id(stack, worker)))
    assert isinstance(raw, bytes)
    return bus.decode_info(raw)


async def test_an_adapter_s_jobs_go_to_the_worker_that_holds_it(stack: Stack) -> None:
    """Two workers serving adapters: an adapter's first job goes to either, which loads it; its next eight, each
    with a prompt of its own, all go to that worker (its heartbeat says it holds the adapter, the other's never
    does), while the base model's prompts still spread over both."""
    edge = stack.edge()
    workers = [stack.worker(enable_lora=True), stack.worker(enable_lora=True)]
    stack.client.hset(keys.ADAPTERS, "tenant-lora", msgspec.json.encode(
        Adapter(name="tenant-lora", base=stack.model, path="/adapters/tenant-lora")))
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:

        async def ask_in_own_words(model: str, n: int) -> str:
            completion = await client.chat.completions.create(model=model, max_tokens=3, messages=[
                {"role": "user", "content": f"{n} " * 300}])
            assert completion.model == model
            return completion.choices[0].message.content or ""

        assert await ask_in_own_words("tenant-lora", 0) == expected(3)
        await until(lambda: any("tenant-lora" in heartbeat(stack, w).held for w in workers))
        holder, other = sorted(workers, key=lambda w: "tenant-lora" not in heartbeat(stack, w).held)
        answers = await asyncio.gather(*(ask_in_own_words("tenant-lora", n) for n in range(1, 9)))
        assert answers == [expected(3)] * 8
        await asyncio.gather(*(ask_in_own_words(stack.model, n) for n in range(100, 116)))
    await asyncio.sleep(2.5)  # a heartbeat more: what each worker holds after them all
    assert heartbeat(stack, holder).held == ["tenant-lora"] and heartbeat(stack, other).held == []
    assert all(heartbeat(stack, w).max_loras == 4 for w in workers)
    assert all(heartbeat(stack, w).running == 0 for w in workers)
    await stack.settled()


async def test_requests_with_one_prompt_cache_key_go_where_one_of_them_ran(stack: Stack) -> None:
    """Four requests that share no text but their prompt_cache_key go to the worker that ran the first one."""
    edge = stack.edge()
    first = stack.worker(sim_prefix_cache_blocks=1000)
    async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as client:
        async def chat(text: str) -> str | None:
            answer = await client.chat.completions.create(model=stack.model, max_tokens=2, prompt_cache_key="k",
                                                          messages=[{"role": "user", "content": text}])
            return answer.choices[0].message.content

        await chat("the first")
        key = keys.prefixes(stack.model, worker_id(stack, first))
        await until(lambda: bool(stack.client.scard(key)))
        second = stack.worker(sim_prefix_cache_blocks=1000)
        assert await asyncio.gather(*(chat(f"unrelated {i}") for i in range(4))) == [expected(2)] * 4
    assert (await decisions(stack))["cache"] == 4
    async with httpx.AsyncClient() as http:
        text = (await http.get(second.metrics_url)).text
    assert metric_value(text, "tokenbus_worker_prefix_cache_queries_total", {"model": stack.model}) == 0
