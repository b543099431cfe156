"""The worker's grammar gate (services.worker.grammar_gate): each constraint compiled first with the real XGrammar
and SmolLM2's vocabulary, in helper processes, within a deadline; no engine. What a worker with it answers is in
tests/test_structured.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from services.worker.grammar_gate import GrammarGate
from services.worker.models import default_chat_model_dir
from services.worker.vllm_terms import compiled_spec, xgrammar_vocabulary
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, Overloaded

DEADLINE_S = 1.0
MODEL = "gated"
TOOL = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 14}},
        "required": ["city"]}


def slow_schema(first_length: int = 1000) -> dict[str, Any]:
    """20 strings of distinct bounded lengths: each costs XGrammar ~0.3-0.6 s of one core here, together far past
    the deadline (a 64 KiB schema holds 1,400 of them)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": first_length + i}
                                             for i in range(20)}}


def schema(value: dict[str, Any]) -> bus.Constraint:
    return bus.Constraint(kind="json", spec=json.dumps(value))


@pytest.fixture(scope="module")
async def gate() -> AsyncIterator[GrammarGate]:
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    made = GrammarGate(xgrammar_vocabulary(tokenizer, len(tokenizer)), DEADLINE_S, compiled_spec, MODEL)
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
    assert time.monotonic() - started < 30  # the compile alone takes 6-12 s here; a fresh helper starts in ~2 s
    await gate.check(schema({**TOOL, "description": "after"}), "a")


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
    broken = GrammarGate(b"not a vocabulary", DEADLINE_S, compiled_spec)
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
