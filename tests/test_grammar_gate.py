"""The worker's grammar gate (services.worker.grammar_gate): each constraint compiled first with the real XGrammar
and SmolLM2's vocabulary, in helper processes, within a bound of CPU time; no engine. What a worker with it answers
is in tests/test_structured.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from services.worker import grammar_gate
from services.worker.grammar_compile import compile_spec
from services.worker.grammar_gate import GrammarGate
from services.worker.models import default_chat_model_dir
from services.worker.vllm_terms import compiled_spec, xgrammar_vocabulary
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, Overloaded

MODEL = "gated"
TOOL = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 14}},
        "required": ["city"]}
EMAIL = {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string", "maxLength": 200},
                                          "body": {"type": "string"}}, "required": ["to", "subject"]}
"""A tool whose subject line is bounded: what XGrammar takes for it on one thread sets the gate's bound here (1.4 s
of CPU time on an AMD EPYC core, 3.5 s on a 2.1 GHz Xeon's: a fixed bound passed on one and failed on the other)."""


def one_thread_compile_s(tokenizer: Any, value: dict[str, Any]) -> float:
    """The CPU time XGrammar takes here to compile a schema on one thread, as the gate's helper does."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)),
                                   max_threads=1, cache_enabled=False)
    started = time.process_time()
    compile_spec(compiler, "json", json.dumps(value))
    return time.process_time() - started


def slow_schema(first_length: int = 1000) -> dict[str, Any]:
    """20 strings of distinct bounded lengths: each costs XGrammar about what EMAIL does, together far past the
    bound (a 64 KiB schema holds 1,400 of them)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": first_length + i}
                                             for i in range(20)}}


def schema(value: dict[str, Any]) -> bus.Constraint:
    return bus.Constraint(kind="json", spec=json.dumps(value))


@pytest.fixture(scope="module")
def bound_s() -> float:
    """The gate's bound here, 1 s at least: 3/4 of what EMAIL takes on one thread, so that EMAIL takes longer than the
    bound on the helper's one thread and fits the CPU time the gate allows (two cores' worth: 1.5 times EMAIL's)."""
    return max(1.0, 0.75 * one_thread_compile_s(AutoTokenizer.from_pretrained(default_chat_model_dir()), EMAIL))


@pytest.fixture(scope="module")
async def gate(bound_s: float) -> AsyncIterator[GrammarGate]:
    """A gate as on a two-core machine, whatever the cores (the engine's threads have two: twice the bound of CPU
    time), its bound set by this machine's speed (bound_s)."""
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grammar_gate, "cores", lambda: 2)
        # a wait bound far past what a loaded test machine (pytest -n 2) needs: CPU time decides here
        made = GrammarGate(xgrammar_vocabulary(tokenizer, len(tokenizer)), bound_s, compiled_spec, MODEL,
                           busy_s=120)
    await made.start()
    yield made
    await made.close()


def checks(outcome: str) -> float:
    """What the worker's metrics say of the gate's checks (tokenbus_worker_constraint_checks_total)."""
    return REGISTRY.get_sample_value("tokenbus_worker_constraint_checks_total",
                                     {"model": MODEL, "outcome": outcome}) or 0.0


@pytest.fixture
def asked(gate: GrammarGate, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The lines the gate sends its helpers."""
    lines: list[bytes] = []
    ask = gate._helpers.ask

    async def counted(line: bytes, tenant: str) -> bytes:
        lines.append(line)
        return await ask(line, tenant)

    monkeypatch.setattr(gate._helpers, "ask", counted)
    return lines


async def test_a_constraint_that_compiles_in_time_goes_on_and_is_compiled_once(gate: GrammarGate,
                                                                                 asked: list[bytes]) -> None:
    tool = schema({**TOOL, "description": "once"})
    compiled, known = checks("compiled"), checks("known")
    await asyncio.gather(*(gate.check(tool, tenant) for tenant in ("a", "a", "b")))  # sent together: one compile
    await gate.check(tool, "c")  # sent again: remembered
    assert (checks("compiled") - compiled, checks("known") - known) == (1, 1)
    for constraint in (bus.Constraint(kind="regex", spec="[0-9]{3}-[0-9]{4}"),
                       bus.Constraint(kind="choice", spec=json.dumps(["yes", "no"]))):
        await gate.check(constraint, "a")
    assert [json.loads(line)[0] for line in asked] == ["json", "regex", "grammar"]


async def test_a_constraint_past_the_deadline_is_refused_and_the_next_one_compiles(gate: GrammarGate) -> None:
    started, too_slow = time.monotonic(), checks("too_slow")
    with pytest.raises(InvalidRequest, match="takes too long to compile") as caught:
        await gate.check(schema(slow_schema()), "a")
    assert caught.value.code == "invalid_structured_output"
    assert checks("too_slow") == too_slow + 1
    # the compile alone takes ~20 times EMAIL's CPU time; refused at twice the bound of it (rounded up to whole
    # seconds), in wall time as the host's load allows, within the wait's bound at worst; a fresh helper starts in ~2 s
    assert time.monotonic() - started < gate.busy_s + 10
    await gate.check(schema({**TOOL, "description": "after"}), "a")
    again, known_too_slow = time.monotonic(), checks("known_too_slow")
    with pytest.raises(InvalidRequest, match="takes too long to compile"):  # its cost is what it was: no new compile
        await gate.check(schema(slow_schema()), "b")
    assert checks("known_too_slow") == known_too_slow + 1 and time.monotonic() - again < 0.5


def helper_pids(gate: GrammarGate) -> list[int]:
    return [slot.running.process.pid for slot in gate._helpers._slots if slot.running is not None]


def stopped(pids: list[int], stop: bool) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # the gate ended it meanwhile
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)


async def test_a_constraint_the_engines_threads_compile_within_the_bound_goes_on(gate: GrammarGate) -> None:
    """A tool whose subject line is bounded (EMAIL): on the engine's 8 threads over these two cores it takes 2/3 of
    the bound (bound_s). The helper compiles it on one thread, in 4/3 of the bound: judged by that wall time, as the
    gate first did, it was refused, though vLLM would have served it."""
    compiled = checks("compiled")
    await gate.check(schema(EMAIL), "a")
    assert checks("compiled") == compiled + 1


async def test_a_compile_the_host_gives_little_cpu_is_judged_by_the_cpu_it_takes(gate: GrammarGate) -> None:
    """The helpers stopped for 1.5 s (a host busy with other work) while a constraint about as costly as EMAIL compiles:
    past the bound in wall time, within it in CPU time, so it goes on (a wall-time deadline refused it, and would
    refuse it on any busy host)."""
    pids = helper_pids(gate)
    checking = asyncio.create_task(gate.check(schema({**TOOL, "properties": {"s": {"type": "string", "maxLength": 150}},
                                                      "description": "starved"}), "a"))
    await asyncio.sleep(0.05)
    stopped(pids, True)
    try:
        await asyncio.sleep(1.5)
    finally:
        stopped(pids, False)
    await checking  # compiled, not refused


async def test_a_compile_the_host_starves_past_its_wall_bound_is_refused_for_now(gate: GrammarGate,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped past the wall bound (BUSY_FACTOR times the bound; set to 2.5 s here): a 503 to try again, not the
    constraint's fault, and the next constraint compiles on a fresh helper."""
    monkeypatch.setattr(gate._helpers, "deadline_s", 2.5)
    pids = helper_pids(gate)
    busy = checks("busy")
    checking = asyncio.create_task(gate.check(schema({**TOOL, "properties": {"s": {"type": "string", "maxLength": 160}},
                                                      "description": "stopped"}), "a"))
    await asyncio.sleep(0.05)
    stopped(pids, True)
    try:
        with pytest.raises(Overloaded, match="too busy to compile"):
            await checking
    finally:
        stopped(pids, False)
    assert checks("busy") == busy + 1
    await gate.check(schema({**TOOL, "description": "after the stop"}), "a")


async def test_one_tenants_slow_constraints_hold_none_of_anothers_back(gate: GrammarGate) -> None:
    async def refused(first_length: int) -> None:
        with pytest.raises(InvalidRequest):
            await gate.check(schema(slow_schema(first_length)), "hostile")

    flood = [asyncio.create_task(refused(2000 + 100 * i)) for i in range(3)]
    await asyncio.sleep(0.1)  # the first is compiling, the other two wait in the tenant's line
    await gate.check(schema({**TOOL, "description": "beside"}), "other")
    assert not any(task.done() for task in flood)  # served while the flood's first still compiled
    await asyncio.gather(*flood)


async def test_a_compile_whose_helper_ends_is_refused_and_the_next_one_compiles(gate: GrammarGate) -> None:
    """A helper ends when a compile passes its memory bound (grammar_compile.MEMORY_BYTES); here it is killed."""
    refused = asyncio.create_task(gate.check(schema(slow_schema(4000)), "a"))
    await asyncio.sleep(0.3)
    for slot in gate._helpers._slots:
        if slot.running is not None:
            slot.running.process.kill()
    with pytest.raises(InvalidRequest, match="ended before it finished") as caught:
        await refused
    assert caught.value.code == "invalid_structured_output"
    await gate.check(schema({**TOOL, "description": "after the end"}), "a")


async def test_a_gate_whose_helpers_cannot_start_refuses_for_now_and_serves_what_it_knows() -> None:
    """A helper that cannot start (here: a vocabulary XGrammar cannot read) leaves constraints unchecked for
    the engine: refused as overloaded (503, to be tried again), never passed on unchecked."""
    broken = GrammarGate(b"not a vocabulary", 1.0, compiled_spec)
    try:
        await broken.start()  # logged, not raised: the worker serves what needs no constraint
        with pytest.raises(Overloaded, match="cannot compile constraints now"):
            await broken.check(schema(TOOL), "a")
        await broken.check(bus.Constraint(kind="json_object"), "a")  # nothing to compile
    finally:
        await broken.close()


async def test_what_xgrammar_refuses_goes_on_to_the_engines_own_check(gate: GrammarGate) -> None:
    """vLLM refuses these itself (a 400 of its own, tests/test_structured.py) or gives them to llguidance."""
    for constraint in (bus.Constraint(kind="regex", spec="(a)\\1"),
                       schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}}),
                       bus.Constraint(kind="json", spec="not json"), bus.Constraint(kind="json_object")):
        await gate.check(constraint, "a")
