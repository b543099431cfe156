"""Constraints compiled first, within a deadline, where a slow one can be stopped.

vLLM's engine compiles a request's constraint (a JSON schema, a regex, a choice, a structural tag) with XGrammar on a
thread pool of its engine core: half its cores, one on a two-core machine. The compile has no deadline, and nothing
stops it once begun: aborting the request leaves its thread compiling. Its cost is not bounded by the schema's size:
each distinct bounded string length of 1,000 or more costs ~0.3 s of one core with SmolLM2's 49k vocabulary (more
with larger ones), so a 64 KiB schema buys minutes, while every other constrained request on the engine waits.

So before a job's constraint reaches the engine, the worker compiles it the same way in a helper process
(services.worker.grammar_compile, shared.runtime.helpers: one core, niced), within `grammar_compile_s`. One that
compiles in time goes on (the engine compiles it again, about as fast); one past the deadline, or whose compile
ran out of memory, is refused with a 400 and the helper replaced. What XGrammar refuses goes on too: vLLM refuses
it, or gives it to its llguidance fallback. Schemas that vLLM's check gives llguidance are compiled here too: once
the engine's first constraint chose XGrammar, the engine compiles them with XGrammar. Constraints that compiled in
time are remembered (the KNOWN most recent): a tool schema sent with every request is compiled here once. Two
helpers, at most one of each tenant's constraints waiting for them: one tenant's slow constraints hold none of
another's back."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable

import orjson

from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, Overloaded
from shared.runtime import helpers, metrics

log = logging.getLogger(__name__)

HELPERS = 2
KNOWN = 4096
"""Constraints remembered as compiled in time (their digests), the least recently used forgotten first."""
START_TIMEOUT_S = 120.0
"""How long a helper may take to start: an interpreter, xgrammar and torch, the vocabulary."""
HELPER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "CUDA_VISIBLE_DEVICES": ""}
"""A helper runs on one core, and never touches a GPU (xgrammar imports torch)."""


class GrammarGate:
    """Compiles each constraint the engine will compile (`compiled_spec`: vllm_terms.compiled_spec) first, within
    `deadline_s`, with `vocabulary` (vllm_terms.xgrammar_vocabulary)."""

    def __init__(self, vocabulary: bytes, deadline_s: float,
                 compiled_spec: Callable[[bus.Constraint], tuple[str, str] | None], model: str = "") -> None:
        self.deadline_s = deadline_s
        self._checks = functools.partial(metrics.CONSTRAINT_CHECKS.labels, model)
        self._compiled_spec = compiled_spec
        self._helpers = helpers.Helpers("services.worker.grammar_compile", deadline_s=deadline_s,
                                        start_timeout_s=START_TIMEOUT_S, size=HELPERS, greeting=vocabulary + b"\n",
                                        env=HELPER_ENV)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._compiling: dict[bytes, asyncio.Task[None]] = {}

    async def check(self, constraint: bus.Constraint, tenant: str) -> None:
        """Returns once the constraint compiled within the deadline (or is not one the engine compiles);
        InvalidRequest if it did not, Overloaded if no helper could start."""
        key = hashlib.blake2b(f"{constraint.kind}\0{constraint.spec}".encode(), digest_size=16).digest()
        if key in self._known:
            self._known.move_to_end(key)
            self._checks("known").inc()
            return
        compiling = self._compiling.get(key)
        if compiling is None:  # the same constraint sent again meanwhile waits for this compile
            compiling = self._compiling[key] = asyncio.create_task(self._compile(key, constraint, tenant))
            compiling.add_done_callback(functools.partial(self._done, key))
        await asyncio.shield(compiling)  # a caller that goes away leaves it to finish, in its tenant's turn

    def _done(self, key: bytes, task: asyncio.Task[None]) -> None:
        del self._compiling[key]
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have gone

    async def _compile(self, key: bytes, constraint: bus.Constraint, tenant: str) -> None:
        spec = self._compiled_spec(constraint)
        if spec is not None:
            try:
                refusal = orjson.loads(await self._helpers.ask(orjson.dumps(spec), tenant))
            except helpers.TookTooLong:
                self._checks("too_slow").inc()
                log.warning("a %s constraint took over %g s to compile; refused", constraint.kind, self.deadline_s)
                raise InvalidRequest(f"The constraint takes too long to compile (over {self.deadline_s:g} s); make "
                                     "it smaller or simpler.", code="invalid_structured_output") from None
            except helpers.Ended:
                self._checks("ended").inc()
                log.warning("the grammar compiler ended while it compiled a %s constraint; refused", constraint.kind)
                raise InvalidRequest("The constraint's compile ended before it finished (past its memory bound, or "
                                     "stopped); make it smaller or simpler.", code="invalid_structured_output",
                                     ) from None
            except helpers.NotStarted:
                self._checks("unavailable").inc()
                log.warning("the grammar compiler did not start")
                raise Overloaded("The worker cannot compile constraints now; try again shortly.") from None
            if refusal is not None:  # vLLM's own check answers it (the refusal may quote the request: not logged)
                log.debug("XGrammar refused a %s constraint; vLLM's check answers it", constraint.kind)
                self._checks("refused_by_xgrammar").inc()
                return
        self._checks("compiled" if spec is not None else "skipped").inc()
        self._known[key] = None
        if len(self._known) > KNOWN:
            self._known.popitem(last=False)

    async def start(self) -> None:
        """Starts the helpers now (else the first constrained request waits for one)."""
        try:
            await self._helpers.start()
        except helpers.NotStarted:
            log.warning("the grammar compiler did not start; it is tried again on the next constraint")

    async def close(self) -> None:
        await self._helpers.close()
