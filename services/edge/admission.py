"""Admission of a request for its key: the estimate of what it may cost, the atomic step in Redis that
admits it against every limit of the key or refuses it, the concurrency lease it holds while the edge
serves it, and what happens when Redis cannot answer that step (the `admission_when_redis_down` policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from services.edge.auth import Caller
from services.edge.estimate import estimate
from services.edge.redis_boundary import REDIS_FAILURES, unavailable
from shared.protocol import bus
from shared.protocol.errors import QuotaExceeded, RateLimited
from shared.runtime import beats, metrics
from shared.runtime.background import looping
from shared.tenancy.apikeys import KeyRecord
from shared.tenancy.limits import WINDOW_MS, Admission, Limits, Settlements, Verdict, headers, period_end

log = logging.getLogger(__name__)

ADMISSION_TIMEOUT_S = 2.0
BATCH_PRIORITY = -1
"""The priority band of batch lines: below every key's (0 to 9), so queued interactive work always goes first."""
NO_MODEL_YET = "-"
"""The model label of a request refused before its body was read."""


@dataclass
class LocalLimits:
    """Each edge's own part of every key's rpm and tpm (the limit divided by the live edges), for while
    Redis cannot answer the admission step and the policy is `local`."""

    edges: Callable[[], int]
    tats: dict[tuple[str, str], float] = field(default_factory=dict)

    def admit(self, record: KeyRecord, tokens: int, requests: int) -> Verdict:
        now = time.time() * 1000
        share = max(1, self.edges())
        found: dict[str, tuple[float, float]] = {}
        for kind, limit, cost in (("requests", record.rpm, requests), ("tokens", record.tpm, tokens)):
            if limit:
                tat = max(self.tats.get((record.id, kind), now), now)
                found[kind] = (tat, tat + cost * WINDOW_MS * share / limit)
        over = {kind: after - now - WINDOW_MS for kind, (_tat, after) in found.items()}
        refused = max((kind for kind in over if over[kind] > 0), key=lambda kind: over[kind], default="")
        if not refused:
            for kind, (_tat, after) in found.items():
                self.tats[(record.id, kind)] = after
        state = {kind: (tat if refused else after) - now for kind, (tat, after) in found.items()}
        left = {kind: max(0, int((WINDOW_MS - state[kind]) * limit / (WINDOW_MS * share) + 1e-6))
                for kind, limit in (("requests", record.rpm), ("tokens", record.tpm)) if kind in state}
        return Verdict(refused, int(over.get(refused, 0)), int(state.get("requests", 0)),
                       int(state.get("tokens", 0)), left.get("requests", 0), left.get("tokens", 0))


class Admitter:
    """Admits requests for their callers' keys and keeps the leases of those it serves alive."""

    def __init__(self, limits: Limits, settlements: Settlements, policy: str, edges: Callable[[], int],
                 max_tenant_labels: int = 20, shared_prompt_cache: bool = False) -> None:
        self.limits = limits
        self.shared_prompt_cache = shared_prompt_cache
        self.settlements = settlements
        self.policy = policy
        self.local = LocalLimits(edges)
        self.tenants = metrics.TenantLabels(max_tenant_labels)
        self.held: dict[tuple[str, str], float | None] = {}
        """(key id, lease) of the jobs this edge holds leases for, renewed every round: None while it serves the
        job, else until when (monotonic) it keeps the lease of a job left running for a resume."""

    async def take_request(self, caller: Caller) -> dict[str, str]:
        """Spends one request of the caller's rpm (and checks its quota) before the request is even read: a
        request refused later, as invalid or over another limit, has still cost its sender (as at OpenAI).
        Returns the key's x-ratelimit-* headers."""
        record = caller.key
        if record is None or not (record.rpm or record.quota_tokens):
            return {}
        try:
            async with asyncio.timeout(ADMISSION_TIMEOUT_S):
                verdict = await self.limits.check(record, 0, "", requests=1)
        except REDIS_FAILURES as exc:
            log.warning("admission step failed (%s); policy %s", type(exc).__name__, self.policy)
            self._without_redis(record, 0, requests=1)
            return {}
        found = headers(record, verdict)
        if verdict.refused:
            metrics.TENANT_REQUESTS.labels(self.tenants.label(caller.tenant), NO_MODEL_YET, verdict.refused).inc()
            raise _refusal(record, verdict, 0, found)
        return found

    async def admit(self, caller: Caller, job: bus.Job, max_model_len: int) -> Admission:
        """Marks the job with its caller and cost and admits it against the caller's limits (its request was
        taken already), or raises RateLimited / QuotaExceeded (with their headers on the caller's answer)
        without spending anything more."""
        prompt, output = estimate(job, max_model_len)
        self._mark(caller, job, prompt, output)
        record = caller.key
        if record is None:
            job.charge = bus.Charge(key="-", tokens=prompt + output)
            return Admission()
        job.weight, job.priority = record.weight, record.priority
        tokens = prompt + output
        lease = uuid.uuid4().hex if record.max_concurrency else ""
        try:
            async with asyncio.timeout(ADMISSION_TIMEOUT_S):
                verdict = await self.limits.check(record, tokens, lease, requests=0)
        except REDIS_FAILURES as exc:
            log.warning("admission step failed (%s); policy %s", type(exc).__name__, self.policy)
            self._without_redis(record, tokens, requests=0)
            job.charge = None  # nothing was reserved in Redis, so nothing is settled there
            return Admission()
        found = headers(record, verdict)
        if verdict.refused:
            raise _refusal(record, verdict, tokens, found)
        job.charge = bus.Charge(key=record.id, tokens=tokens, tpm=record.tpm,
                                quota_window=record.quota_window() if record.quota_tokens else "", lease=lease)
        if lease:
            self.held[(record.id, lease)] = None
        return Admission(found, lease)

    def _mark(self, caller: Caller, job: bus.Job, prompt: int, output: int) -> None:
        job.tenant, job.prompt_estimate, job.output_budget = caller.tenant, prompt, output
        job.cache_salt = "" if self.shared_prompt_cache else caller.tenant

    async def admit_batch(self, caller: Caller, job: bus.Job, max_model_len: int) -> None:
        """Marks a batch line's job with its caller and cost, in the batch lane (below every key's priority band,
        its usage counted apart), and charges it to the key's token quota, or raises QuotaExceeded. A batch line
        spends none of the key's rpm, tpm or concurrency: it takes only capacity nobody else waits for."""
        prompt, output = estimate(job, max_model_len)
        self._mark(caller, job, prompt, output)
        job.priority = BATCH_PRIORITY
        record = caller.key
        if record is None:
            job.charge = bus.Charge(key="-", tokens=prompt + output, lane="batch")
            return
        job.weight = record.weight
        quota_only = msgspec.structs.replace(record, rpm=0, tpm=0, max_concurrency=0)
        async with asyncio.timeout(ADMISSION_TIMEOUT_S):
            verdict = await self.limits.check(quota_only, prompt + output, "", requests=0)
        if verdict.refused:
            raise _refusal(record, verdict, prompt + output, {})
        job.charge = bus.Charge(key=record.id, tokens=prompt + output,
                                quota_window=record.quota_window() if record.quota_tokens else "", lane="batch")

    def _without_redis(self, record: KeyRecord, tokens: int, requests: int) -> None:
        if self.policy == "closed":
            raise unavailable()
        if self.policy == "local":
            verdict = self.local.admit(record, tokens, requests)
            if verdict.refused:
                raise _refusal(record, verdict, tokens, headers(record, verdict))

    async def peek(self, caller: Caller) -> dict[str, str]:
        """The headers of a key's current state, spending nothing (routes that run no model)."""
        if caller.key is None or not (caller.key.rpm or caller.key.tpm):
            return {}
        try:
            async with asyncio.timeout(ADMISSION_TIMEOUT_S):
                return headers(caller.key, await self.limits.check(caller.key, 0, "", consume=False))
        except REDIS_FAILURES:
            return {}

    def hold(self, key_id: str, lease: str) -> None:
        """Renews a lease this edge did not take: the one of a job it resumes."""
        if lease:
            self.held[(key_id, lease)] = None

    async def release(self, key_id: str, lease: str, *, keep_for_s: float = 0.0) -> None:
        """Gives a job's lease back; `keep_for_s`: the job runs on (kept for a resume), so its lease is renewed for
        that long still, unless the worker that ends the job gives it back first."""
        if not lease:
            return
        if keep_for_s > 0:
            self.held[(key_id, lease)] = time.monotonic() + keep_for_s
            return
        self.held.pop((key_id, lease), None)
        with contextlib.suppress(*REDIS_FAILURES):  # unreleased, it expires within the lease TTL
            await self.limits.release(key_id, lease)

    async def refund(self, job: bus.Job) -> None:
        """Gives a job's tokens and lease back: it was admitted but could not be queued (its request stays spent)."""
        with contextlib.suppress(*REDIS_FAILURES):
            await self.settlements.refund(job)

    async def renew(self, interval_s: float) -> None:
        while True:
            await beats.sleep_to_beat(interval_s)
            now = time.monotonic()
            for held in [held for held, until in self.held.items() if until is not None and until < now]:
                del self.held[held]  # the job's window is over: its worker gave the lease back or soon will
            try:
                await self.limits.renew(list(self.held))
            except REDIS_FAILURES as exc:
                log.warning("renewing concurrency leases failed (%s)", type(exc).__name__)


def _refusal(record: KeyRecord, verdict: Verdict, tokens: int, found: dict[str, str]) -> RateLimited:
    if verdict.refused == "quota":
        wait_s = period_end(record, time.time()) - time.time()
        error: RateLimited = QuotaExceeded(
            f"You exceeded your quota of {record.quota_tokens} tokens per {record.quota_period}.",
            limit="insufficient_quota", retry_after_s=wait_s)
    elif verdict.refused == "too_large":
        error = RateLimited(f"The request needs up to {tokens} tokens, more than the key's limit of "
                            f"{record.tpm} tokens per minute; lower max_tokens.", limit="tokens",
                            retry_after_s=60)
    elif verdict.refused == "concurrency":
        error = RateLimited(f"The key already has {record.max_concurrency} requests in flight; wait for one "
                            "to finish.", limit="concurrency", retry_after_s=verdict.wait_ms / 1000)
    else:
        limit = record.rpm if verdict.refused == "requests" else record.tpm
        error = RateLimited(f"Rate limit reached: {limit} {verdict.refused} per minute for this key. "
                            f"Try again in {verdict.wait_ms / 1000:.1f}s.", limit=verdict.refused,
                            retry_after_s=verdict.wait_ms / 1000)
    error.headers = found
    return error


def renewing(admitter: Admitter, interval_s: float) -> contextlib.AbstractAsyncContextManager[None]:
    return looping(lease_renewal=admitter.renew(interval_s))
