"""Which models have a live worker, read from the workers' heartbeats in the background, and the LoRA adapters
they serve (the registry of `tokenbus adapters`, read with them): a request looks either up without a round trip
to Redis, and never scans the keyspace."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import redis.asyncio as aioredis

from services.edge.redis_boundary import REDIS_FAILURES
from shared.protocol import bus, keys
from shared.redisio import rawpipe
from shared.runtime import beats, metrics
from shared.runtime.background import looping
from shared.tenancy import adapters as adapter_registry
from shared.tenancy.adapters import Adapter

log = logging.getLogger(__name__)

PRUNE_AFTER_S = 300.0
"""A worker missing from the registry this long after its heartbeat expired is dropped from it."""


class ModelDirectory:
    """The models of live workers, and for each the heartbeat of its worker with the most slots."""

    def __init__(self, redis: aioredis.Redis, expected: list[str] | None = None, refresh_s: float = 2.0) -> None:
        self.redis = redis
        self.pipelines = rawpipe.Pipelines(redis, keep=False)
        """Its reads, every `refresh_s`: raw pipelines cost the edge's CPU a fraction of redis-py's."""
        self.refresh_s = refresh_s
        """The workers' heartbeat interval: reading more often learns nothing new."""
        self.expected = list(expected or [])
        """The models this deployment serves: their live-worker gauge shows 0 until a worker beats."""
        self.counted: set[str] = set(self.expected)
        """Models whose gauges were set: a model whose last worker died goes back to 0, not away."""
        self.came_up: set[str] = set()
        """The expected models that have had a live worker since the edge started: once all have, the deployment
        is up, and a model whose workers all go later (a restart) is answered per request, not by /ready."""
        for model in self.expected:
            metrics.edge_series(model)
            metrics.LIVE_WORKERS.labels(model).set(0)
            metrics.FREE_SLOTS.labels(model).set(0)
        self.models: dict[str, bus.WorkerInfo] = {}
        self.adapters: dict[str, Adapter] = {}
        """Every adapter known: those added to the registry, and those workers were started with (--lora)."""
        self.lora_models: set[str] = set()
        """Models with a live worker that serves adapters."""
        self.workers: set[str] = set()
        """Ids of the workers whose heartbeat was alive at the last read."""
        self.resting: set[str] = set(self.expected)
        """Models with no live worker now that are served here all the same: those this deployment expects, and
        those of the registry's workers whose heartbeats lapsed less than PRUNE_AFTER_S ago (they restart)."""
        self.names: list[bytes] = []
        """The registry's heartbeat keys at the last read: read with it next time, in the same round trip."""
        self.loaded = False
        self._reading: asyncio.Task[dict[str, bus.WorkerInfo]] | None = None

    async def refresh(self) -> dict[str, bus.WorkerInfo]:
        """Reads every registered worker's heartbeat; callers that come meanwhile share the same read."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read(), name="model-directory-read")
        self.models = await asyncio.shield(self._reading)
        return self.models

    def alive(self, worker_id: str) -> bool:
        """Whether the worker's heartbeat was alive at the last read (or no read has succeeded yet)."""
        return not self.loaded or worker_id in self.workers

    async def find(self, name: str) -> tuple[bus.WorkerInfo | None, Adapter | None]:
        """The heartbeat of the model of that name, or the adapter of that name; one fresh read first when neither
        is known (its worker may have just started, it may have just been added)."""
        if name not in self.models and name not in self.adapters:
            await self.refresh()
        return self.models.get(name), self.adapters.get(name)

    async def _read(self) -> dict[str, bus.WorkerInfo]:
        """One round trip while the registry keeps its members: their heartbeats are read with it (not MGET: on
        a Redis Cluster they lie in many slots); a second one for the heartbeats of workers new to it."""
        known = self.names
        pipe = self.pipelines.pipeline()
        pipe.execute_command("ZREMRANGEBYSCORE", keys.WORKERS, "-inf", time.time() - PRUNE_AFTER_S)
        pipe.execute_command("ZRANGE", keys.WORKERS, 0, -1)
        pipe.execute_command("HGETALL", keys.ADAPTERS)
        for name in known:
            pipe.execute_command("GET", name)
        _pruned, names, registry, *bodies = await pipe.execute()
        heartbeats = dict(zip(known, bodies, strict=True))
        if new := [name for name in names if name not in heartbeats]:
            reads = self.pipelines.pipeline()
            for name in new:
                reads.execute_command("GET", name)
            heartbeats.update(zip(new, await reads.execute(), strict=True))
        self.names = names
        found: dict[str, bus.WorkerInfo] = {}
        started_with: dict[str, Adapter] = {}
        lora_models: set[str] = set()
        workers: set[str] = set()
        live: dict[str, int] = {}
        free: dict[str, int] = {}
        lapsed: set[str] = set()
        features: dict[str, set[str]] = {}
        for key, raw in zip(names, map(heartbeats.__getitem__, names), strict=True):
            if not isinstance(raw, bytes):  # that heartbeat expired (or its worker stopped)
                lapsed.add(keys.model_of_heartbeat(key))
            else:
                info = bus.decode_info(raw)
                if info.model not in found or info.slots > found[info.model].slots:  # the largest job it can run
                    found[info.model] = info
                workers.add(info.worker)
                features[info.model] = features.get(info.model, set(info.features)) & set(info.features)
                if info.max_loras:
                    lora_models.add(info.model)
                    started_with.update((name, Adapter(name=name, base=info.model)) for name in info.adapters)
                live[info.model] = live.get(info.model, 0) + 1
                free[info.model] = free.get(info.model, 0) + max(0, info.slots - info.running)
        for model, common in features.items():  # what every live worker of the model takes
            found[model] = msgspec.structs.replace(found[model], features=sorted(common))
        self.workers, self.loaded, self.lora_models = workers, True, lora_models
        self.resting = (lapsed | set(self.expected)) - found.keys()
        self.adapters = started_with | {name.decode(): adapter_registry.decode(raw) for name, raw in
                                       rawpipe.field_map(registry or []).items()}
        self.counted |= live.keys()
        for model in self.counted:
            metrics.LIVE_WORKERS.labels(model).set(live.get(model, 0))
            metrics.FREE_SLOTS.labels(model).set(free.get(model, 0))
        self.came_up |= live.keys() & set(self.expected)
        metrics.READY.set(self.up())
        return found

    def up(self) -> bool:
        """Every model the deployment serves has had a live worker since the edge started."""
        return self.came_up >= set(self.expected)

    def visible_adapters(self, tenant: str | None) -> list[Adapter]:
        """The adapters a caller of `tenant` (None: serving without keys) may see whose model has a live worker."""
        return [adapter for _, adapter in sorted(self.adapters.items())
                if adapter.base in self.models and adapter.visible_to(tenant)]

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except REDIS_FAILURES as exc:
                metrics.READY.set(0)
                log.warning("reading the worker registry failed (%s); keeping the last answer", exc)
            await beats.sleep_to_beat(self.refresh_s)

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Keeps the directory fresh for the lifetime of the block."""
        return looping(model_directory=self._refresh_forever())

