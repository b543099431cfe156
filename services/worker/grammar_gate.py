"""Constraints compiled first, within a bound, where a slow one can be stopped.

vLLM's engine compiles a request's constraint (a JSON schema, a regex, a choice, a structural tag) with XGrammar, on
8 threads (as many as the host's cores let it have), in a pool of its engine core. The compile has no deadline, and
nothing stops it once begun: aborting the request leaves it compiling. Its cost is not bounded by the schema's size:
each distinct `maxLength` of 200 or more costs ~1.4 s of CPU time here with SmolLM2's 49k vocabulary and ~3.5 s with
Llama 3's 128k one (docs/sweeps/vocabulary_compile.py), so a 64 KiB schema buys many minutes of the host's cores,
while every other constrained request on the engine waits.

So before a job's constraint reaches the engine, the worker compiles it the same way in a helper process
(services.worker.grammar_compile, shared.runtime.helpers: niced, on `helper_threads`). Its bound is
`grammar_compile_s` as the engine's compile would take it on this host, idle: that many seconds of each of the cores
the engine's 8 threads can have, counted as the CPU time the compile takes (the helper is ended past it: what the
constraint costs decides, not how busy the host is, nor how many threads the helper has). One that compiles
within it goes on (the engine compiles it again); one past it, or whose compile ran out of memory, is refused with a
400 and the helper replaced, and remembered (the REFUSED most recent: the same constraint again is refused at once).
A compile the host gives too little CPU to finish within BUSY_FACTOR times the bound is a 503, to be tried again. What
XGrammar refuses goes on too, to be refused by vLLM's check or by the engine's compile (a 400 either way). Schemas
that vLLM's check gives llguidance are compiled here too: the engine compiles them with XGrammar, the backend the
worker makes it take first (vllm_terms.choose_xgrammar). Constraints that compiled in time are remembered (the KNOWN
most recent): a tool schema sent with every request is compiled here once. Two helpers, at most one of each tenant's
constraints waiting for them: one tenant's slow constraints hold none of another's back."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
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
REFUSED = 1024
"""Constraints remembered as past the bound, the same way: the bound counts CPU time, so its answer stays."""
START_TIMEOUT_S = 120.0
"""How long a helper may take to start: an interpreter, xgrammar and torch, the vocabulary."""
HELPER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "CUDA_VISIBLE_DEVICES": ""}
"""A helper's torch stays on one thread (XGrammar's compile threads are its own), and never touches a GPU."""
ENGINE_THREADS = 8
"""Threads of one compile in the engine: vLLM's XgrammarBackend makes its GrammarCompiler with max_threads=8 (vLLM
0.32)."""
BUSY_FACTOR = 20.0
"""A compile still running after this many times the bound in wall time (10 times what its whole CPU budget takes on
a helper's threads, on two cores or sixteen): the host gives the helper too little CPU (a 503), whatever the
constraint costs. A niced helper beside busy processes gets ~10% of a core."""


def cores() -> int:
    return len(os.sched_getaffinity(0))


def cpu_budget_s(bound_s: float) -> float:
    """The CPU time a compile may take: `bound_s` of each core the engine's compile threads can have here."""
    return bound_s * min(ENGINE_THREADS, cores())


def helper_threads() -> int:
    """A helper's compile threads: a quarter of the cores (one at least, the engine's 8 at most). A compile the gate
    goes on to refuse takes that much of the host from the engine and the streams, niced, and no more: with the
    engine's 8 threads, helpers busy with slow constraints slowed every stream's steps 1.6x here."""
    return max(1, min(ENGINE_THREADS, cores() // 4))


class _Digests:
    """The `size` most recently used digests."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._held: OrderedDict[bytes, None] = OrderedDict()

    def used(self, key: bytes) -> bool:
        """Whether it is held (and it is now the most recently used)."""
        if key not in self._held:
            return False
        self._held.move_to_end(key)
        return True

    def add(self, key: bytes) -> None:
        self._held[key] = None
        if len(self._held) > self.size:
            self._held.popitem(last=False)


class GrammarGate:
    """Compiles each constraint the engine will compile (`compiled_spec`: vllm_terms.compiled_spec) first, within
    `bound_s` as the engine would take it here (see the module's doc), with `vocabulary`
    (vllm_terms.xgrammar_vocabulary); a compile still running after `busy_s` (BUSY_FACTOR times the bound unless
    given) is a 503."""

    def __init__(self, vocabulary: bytes, bound_s: float,
                 compiled_spec: Callable[[bus.Constraint], tuple[str, str] | None], model: str = "",
                 busy_s: float | None = None) -> None:
        self.bound_s = bound_s
        self._checks = functools.partial(metrics.CONSTRAINT_CHECKS.labels, model)
        self._compiled_spec = compiled_spec
        budget_s, threads = cpu_budget_s(bound_s), helper_threads()
        self.busy_s = BUSY_FACTOR * bound_s if busy_s is None else busy_s
        self._helpers = helpers.Helpers("services.worker.grammar_compile", deadline_s=self.busy_s, cpu_s=budget_s,
                                        start_timeout_s=START_TIMEOUT_S, size=HELPERS, greeting=vocabulary + b"\n",
                                        args=[str(threads)], env=HELPER_ENV)
        self._known, self._refused = _Digests(KNOWN), _Digests(REFUSED)
        self._compiling: dict[bytes, asyncio.Task[None]] = {}

    async def check(self, constraint: bus.Constraint, tenant: str) -> None:
        """Returns once the constraint compiled within the bound (or is not one the engine compiles); InvalidRequest
        if it did not, Overloaded if the host left it too little CPU or no helper could start."""
        key = hashlib.blake2b(f"{constraint.kind}\0{constraint.spec}".encode(), digest_size=16).digest()
        if self._known.used(key):
            self._checks("known").inc()
            return
        if self._refused.used(key):
            self._checks("known_too_slow").inc()
            raise self._too_slow()
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
                log.warning("a %s constraint took over %g s to compile; refused", constraint.kind, self.bound_s)
                self._refused.add(key)
                raise self._too_slow() from None
            except helpers.Busy:
                self._checks("busy").inc()
                log.warning("a %s constraint was still compiling after %g s: the host is too busy; refused for now",
                            constraint.kind, self.busy_s)
                raise Overloaded("The worker is too busy to compile this constraint now; try again shortly.",
                                 ) from None
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
        self._known.add(key)

    def _too_slow(self) -> InvalidRequest:
        return InvalidRequest(f"The constraint takes too long to compile (over {self.bound_s:g} s); make it smaller "
                              "or simpler.", code="invalid_structured_output")

    async def start(self) -> None:
        """Starts the helpers now (else the first constrained request waits for one)."""
        try:
            await self._helpers.start()
        except helpers.NotStarted:
            log.warning("the grammar compiler did not start; it is tried again on the next constraint")

    async def close(self) -> None:
        await self._helpers.close()
