"""The worker's adapter loads (services.worker.loras) against a stand-in for vLLM's AsyncLLM: jobs that want the same
new adapter at once share one load and its outcome, and a load cut short by its job's cancel is taken up by the
next job, never left for the others to wait on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.worker.loras import Loras
from shared.protocol import bus
from shared.protocol.errors import AdapterUnavailable


class Llm:
    """add_lora and list_loras as AsyncLLM answers them, slow enough for jobs to overlap."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.loaded: set[int] = set()
        self.adds = 0
        self.gate = asyncio.Event()

    async def list_loras(self) -> set[int]:
        return set(self.loaded)

    async def add_lora(self, lora: Any) -> bool:
        self.adds += 1
        await self.gate.wait()
        if self.fails:
            raise Exception("Call to add_lora method failed: No adapter found")  # as vLLM words it
        self.loaded.add(lora.lora_int_id)
        return True


def job(n: int) -> bus.Job:
    return bus.Job(id=f"j{n}", model="m", reply_to="", deadline_ms=0, adapter="a", adapter_path="/adapters/a")


async def test_jobs_that_want_one_new_adapter_at_once_share_one_load() -> None:
    loras, llm = Loras("m", True, {}), Llm()
    waiting = [asyncio.create_task(loras.request(llm, job(n))) for n in range(3)]
    await asyncio.sleep(0.01)
    llm.gate.set()
    requests = await asyncio.gather(*waiting)
    assert llm.adds == 1 and {r.lora_int_id for r in requests} == {1} and loras.held() == ["a"]


async def test_an_adapter_that_cannot_load_fails_every_job_that_waited_for_it() -> None:
    loras, llm = Loras("m", True, {}), Llm(fails=True)
    waiting = [asyncio.create_task(loras.request(llm, job(n))) for n in range(3)]
    await asyncio.sleep(0.01)
    llm.gate.set()
    outcomes = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(o, AdapterUnavailable) and o.status == 503 for o in outcomes) and llm.adds == 1
    assert loras.held() == []


async def test_a_load_whose_job_is_cancelled_is_taken_up_by_the_next_job() -> None:
    loras, llm = Loras("m", True, {}), Llm()
    first = asyncio.create_task(loras.request(llm, job(1)))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(loras.request(llm, job(2)))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    llm.gate.set()
    assert (await asyncio.wait_for(second, 5)).lora_int_id == 1 and llm.adds == 2
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_worker_without_adapters_refuses_an_adapter_s_job() -> None:
    with pytest.raises(AdapterUnavailable):
        await Loras("m", False, {}).request(Llm(), job(1))
