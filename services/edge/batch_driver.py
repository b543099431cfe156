"""Drives batches to their end. Each open batch has one driving edge at a time, by a lease in Redis it renews;
every edge looks for open batches nobody drives and takes them, so a batch outlives the edge that took it.

A driver plans each line of the input file as its endpoint's route would, charges it to the key's token quota,
and queues it in the batch lane (services.edge.admission.BATCH_PRIORITY: below every key's priority band, so
interactive work always goes first and batches take only idle capacity, fair between tenants as any band is),
with --batch-window lines of the batch queued or running at a time. Each answer is recorded once per custom_id
(services.edge.batch_store): a line an edge was running when it died runs again on the next driver, and only one
answer counts. At the end the answers become the output and error files, in the input file's order."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from services.edge import pump
from services.edge.auth import Caller
from services.edge.batch_store import Batch, BatchError, BatchStore, failed_with
from services.edge.conversation_store import keep_turn
from services.edge.estimate import check_prompt_fits, check_stops
from services.edge.file_store import FileInfo, FileWriter
from services.edge.formats import batches as shapes
from services.edge.formats.base import openai_error
from services.edge.formats.files import BatchLine, batch_lines
from services.edge.plans import PLANNERS, Plan
from services.edge.redis_boundary import REDIS_FAILURES
from services.edge.state import ADMITTER, BATCHES, CONVERSATIONS, FILES, GATEWAY, REDIS, SETTINGS, STORE
from services.edge.store import Quota
from shared.protocol.errors import (
    InvalidRequest,
    ModelNotFound,
    ModelUnavailable,
    Overloaded,
    QuotaExceeded,
    RateLimited,
    TokenbusError,
    WorkerLost,
)
from shared.runtime import beats, metrics
from shared.runtime.background import cancel_and_wait
from shared.tenancy import apikeys, fairshare

log = logging.getLogger(__name__)

PLAN_OF = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings",
           "/v1/responses": "responses"}
"""The planner of each endpoint a batch may run."""
MAX_DRIVEN = 32
"""Open batches one edge drives at once (the rest wait for it, or go to other edges)."""
OPEN_LOOKED_AT = 1000
WATCH_S = 1.0
"""How often a driver looks for a cancel, the batch's expiry and its tenant's storage."""
QUEUE_RETRY_S = 0.5
"""How long a line whose queue was full waits before it is offered again."""
MAX_LOST_WORKERS = 2
"""Workers a line may lose before it fails (a line whose job kills every worker that runs it must not go on)."""
RUN_AGAIN_S = 1.0
"""How long a line whose worker was lost, or whose model has no live worker now, waits before it runs again."""
MAX_EMBEDDING_INPUTS = 50_000
ANSWERS_READ = 500
"""A batch's answers read at once while its files are written (chat answers of a few kB: about a chunk)."""


class BatchDriver:
    """This edge's drivers, and its look for open batches no edge drives."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.driving: dict[str, asyncio.Task[None]] = {}

    @property
    def name(self) -> str:
        return self.app[GATEWAY].relay.channel

    @property
    def ttl_ms(self) -> int:
        return int(self.app[SETTINGS].batch_lease_ttl_s * 1000)

    def _beats(self, period_s: float) -> float:
        """A period of the driver's rounds in whole heartbeats: they run in the wake of the edge's heartbeat."""
        return beats.whole_beats(period_s, self.app[SETTINGS].heartbeat_interval_s)

    async def begin(self, tenant: str, batch_id: str) -> None:
        """Drives a batch this edge just created (unless it drives too many: then another edge will)."""
        if len(self.driving) < MAX_DRIVEN and await self.app[BATCHES].claim(batch_id, self.name, self.ttl_ms):
            self._launch(tenant, batch_id)

    async def look(self) -> None:
        """Takes the open batches whose driver's lease ran out (an edge that died), up to MAX_DRIVEN."""
        store: BatchStore = self.app[BATCHES]
        for tenant, batch_id in await store.open_batches(OPEN_LOOKED_AT):
            if len(self.driving) >= MAX_DRIVEN:
                return
            if batch_id not in self.driving and await store.claim(batch_id, self.name, self.ttl_ms):
                self._launch(tenant, batch_id)

    async def looking(self) -> None:
        while True:
            await beats.sleep_to_beat(self._beats(self.app[SETTINGS].batch_lease_ttl_s / 2))
            try:
                await self.look()
            except (TokenbusError, *REDIS_FAILURES) as exc:
                log.warning("looking for open batches failed: %s", type(exc).__name__)

    def _launch(self, tenant: str, batch_id: str) -> None:
        task = asyncio.create_task(self._drive(tenant, batch_id), name=f"batch-{batch_id}")
        self.driving[batch_id] = task
        metrics.BATCHES_DRIVEN.set(len(self.driving))
        task.add_done_callback(lambda _task: self._ended(batch_id))

    def _ended(self, batch_id: str) -> None:
        self.driving.pop(batch_id, None)
        metrics.BATCHES_DRIVEN.set(len(self.driving))

    async def _drive(self, tenant: str, batch_id: str) -> None:
        store: BatchStore = self.app[BATCHES]
        drive = asyncio.current_task()
        assert drive is not None  # nosec B101: an invariant (tokenbus never runs with -O)
        keeper = asyncio.create_task(self._keep_lease(batch_id, drive))
        try:
            await BatchRun(self.app, tenant, batch_id).drive()
        except (TokenbusError, *REDIS_FAILURES) as exc:  # another edge, or this one, takes it up again later
            log.warning("driving batch %s stopped: %s", batch_id, type(exc).__name__)
        except Exception:
            log.exception("driving batch %s failed", batch_id)
        finally:
            keeper.cancel()
            with contextlib.suppress(TokenbusError, *REDIS_FAILURES):
                await store.release(batch_id, self.name)

    async def _keep_lease(self, batch_id: str, drive: asyncio.Task[None]) -> None:
        """Renews the lease while the batch is driven here; a lease lost (Redis was out longer than it lasts, and
        another edge took the batch) stops this driver."""
        while True:
            await beats.sleep_to_beat(self._beats(self.ttl_ms / 3000))
            try:
                kept = await self.app[BATCHES].renew(batch_id, self.name, self.ttl_ms)
            except (TokenbusError, *REDIS_FAILURES):
                continue
            if not kept:
                drive.cancel()
                return

    async def stop(self) -> None:
        """Stops driving (an edge going away): each batch is another edge's to take once its lease is released."""
        await cancel_and_wait(list(self.driving.values()))


BATCH_DRIVER = web.AppKey("batch_driver", BatchDriver)


class BatchRun:
    """One edge's drive of one batch, from where the batch is to its end."""

    def __init__(self, app: web.Application, tenant: str, batch_id: str) -> None:
        self.app = app
        self.store: BatchStore = app[BATCHES]
        self.tenant = tenant
        self.batch_id = batch_id
        self.stopped = ""
        """Why no more lines start: cancelled, expired, storage_full or invalid_key ("" while they do)."""
        self.key_id = "-"
        self.caller = Caller(tenant=tenant)
        """Whom the lines run for: the batch's key as it is now (the watch reads it again while the batch runs)."""
        self.quota = Quota(0, 0)
        self.running: set[asyncio.Task[None]] = set()

    async def drive(self) -> None:
        found = await self.store.load(self.tenant, self.batch_id)
        if found is None or found.batch.status not in shapes.ACTIVE:
            await self.store.drop_open(self.tenant, self.batch_id)
            return
        batch = found.batch
        self.key_id = found.key
        caller = await self._caller(found.key)
        lines = await self._lines(batch)
        if caller is None or lines is None:
            failed_with(batch, [BatchError(code="invalid_key", message="The API key of the batch was revoked "
                                                  "or has expired.")] if caller is None else [BatchError(
                code="file_not_found", message="The batch's input file was deleted.", param="input_file_id")])
            await self._end(batch, [], "failed")
            return
        self.caller, self.quota = caller, self.app[STORE].quota(caller.key)
        if found.cancel_asked:
            self.stopped = "cancelled"
        elif time.time() >= batch.expires_at:
            self.stopped = "expired"
        if batch.status == "validating" and not self.stopped:
            errors = _invalid(batch, lines)
            if errors:
                failed_with(batch, errors)
                await self._end(batch, lines, "failed")
                return
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
            await self.store.update(self.tenant, batch)
        if batch.status in ("in_progress", "cancelling") and not self.stopped:
            await self._run(batch, lines)
        await self._end(batch, lines, self.stopped or "completed")

    async def _caller(self, key_id: str) -> Caller | None:
        if key_id == "-":
            return Caller(tenant=self.tenant)
        record = await apikeys.get(self.app[REDIS], key_id)
        if record is None or record.expired():
            return None
        return Caller(tenant=record.tenant, key=record)

    async def _lines(self, batch: Batch) -> list[BatchLine] | None:
        try:
            data = await self.app[FILES].content(self.tenant, batch.input_file_id)
            return await asyncio.to_thread(batch_lines, data)
        except TokenbusError:
            return None

    async def _run(self, batch: Batch, lines: list[BatchLine]) -> None:
        """Runs the lines without an answer, in rounds: a line whose answer could not be recorded (Redis failed
        at that moment) runs again in the next round, a second later, until every line has one or the batch
        stops."""
        first = True
        async with _watching(self, batch):
            while not self.stopped:
                answered = await self.store.answered_ids(self.tenant, batch.id)
                todo = [(index, line) for index, line in enumerate(lines) if line.custom_id not in answered]
                if not todo:
                    return
                if not first:
                    await asyncio.sleep(RUN_AGAIN_S)
                first = False
                await self._round(batch, todo)

    async def _round(self, batch: Batch, todo: list[tuple[int, BatchLine]]) -> None:
        window = asyncio.Semaphore(max(1, self.app[SETTINGS].batch_window))
        waiting = len(todo)
        metrics.BATCH_LINES_WAITING.inc(waiting)
        try:
            for index, line in todo:
                await window.acquire()
                if self.stopped:
                    window.release()
                    break
                waiting -= 1
                metrics.BATCH_LINES_WAITING.dec()
                task = asyncio.create_task(self._line(batch, self.caller, index, line))
                self.running.add(task)
                metrics.BATCH_LINES_RUNNING.inc()
                task.add_done_callback(functools.partial(self._line_ended, window))
            await asyncio.gather(*self.running, return_exceptions=True)
        finally:
            metrics.BATCH_LINES_WAITING.dec(waiting)

    def _line_ended(self, window: asyncio.Semaphore, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        metrics.BATCH_LINES_RUNNING.dec()
        window.release()

    async def watch(self, batch: Batch) -> None:
        """Stops the batch when a cancel is asked, its window ends, its answers fill its tenant's storage, or its
        key was revoked or expired: the lines running are cancelled (their jobs with them), the rest never start.
        A change of the key (its models, limits) reaches the lines that start after it."""
        while not self.stopped:
            await beats.sleep_to_beat(WATCH_S)
            with contextlib.suppress(TokenbusError, *REDIS_FAILURES):
                if (caller := await self._caller(self.key_id)) is None:
                    self.stop("invalid_key")
                    return
                self.caller, self.quota = caller, self.app[STORE].quota(caller.key)
                found = await self.store.load(self.tenant, batch.id)
                if found is not None and found.cancel_asked:
                    self.stop("cancelled")
                elif found is not None and self.quota.bytes and found.output_bytes > self.quota.bytes:
                    self.stop("storage_full")
            if time.time() >= batch.expires_at:
                self.stop("expired")

    def stop(self, why: str) -> None:
        if not self.stopped:
            self.stopped = why
            for task in self.running:
                task.cancel()

    async def _line(self, batch: Batch, caller: Caller, index: int, line: BatchLine) -> None:
        """Runs one line and records its answer (unless another driver did)."""
        request_id = f"{batch.id}_{index}"
        usage = (0, 0)
        lost = 0
        try:
            while True:
                try:
                    plan = await self._plan(batch, caller, line)
                    request_id = plan.arrival.job_id
                    body, usage = await self._answer(batch, caller, plan)
                    break
                except (ModelNotFound, ModelUnavailable, WorkerLost) as exc:
                    lost += isinstance(exc, WorkerLost)
                    if (not self._worth_waiting(exc, caller, line) or lost > MAX_LOST_WORKERS
                            or time.time() + RUN_AGAIN_S >= batch.expires_at):
                        raise
                await asyncio.sleep(RUN_AGAIN_S)
            ok, recorded = True, shapes.answered(request_id, line.custom_id, body)
        except TokenbusError as exc:
            if time.time() >= batch.expires_at:  # its deadline was the batch's: it expired with the batch
                self.stop("expired")
                return
            ok, recorded = False, shapes.refused(request_id, line.custom_id, exc.status, openai_error(exc))
        held = await self.store.answer(self.tenant, batch, line.custom_id, recorded, ok, usage)
        metrics.BATCH_LINES.labels(batch.endpoint, "completed" if ok else "failed").inc()
        if self.quota.bytes and held > self.quota.bytes:
            self.stop("storage_full")

    def _worth_waiting(self, error: TokenbusError, caller: Caller, line: BatchLine) -> bool:
        """Whether a line runs again after `error` rather than failing: its worker died with nobody to take its
        job over, or its model has no live worker now but is one this deployment serves (a restart), and the key
        may use it."""
        if isinstance(error, WorkerLost):
            return True
        model = line.head().model
        return (isinstance(model, str) and model in self.app[GATEWAY].directory.counted
                and (caller.key is None or caller.key.may_use(model)))

    async def _plan(self, batch: Batch, caller: Caller, line: BatchLine) -> Plan:
        head = line.head()
        if head.stream:
            raise InvalidRequest("`stream` is not supported in a batch.", param="stream")
        if head.background:
            raise InvalidRequest("`background` is not supported in a batch.", param="background")
        plan = await PLANNERS[PLAN_OF[batch.endpoint]](self.app, caller, bytes(line.body), None)
        info = self.app[GATEWAY].directory.models.get(plan.job.model)
        fairshare.check_fits(plan.job, info)
        check_prompt_fits(plan.job, info.max_model_len if info else 0, plan.route)
        check_stops(plan.job, self.app[SETTINGS].max_stop_sequences, plan.route)
        return plan

    async def _answer(self, batch: Batch, caller: Caller, plan: Plan) -> tuple[bytes, tuple[int, int]]:
        """Queues the line's job in the batch lane (again and again while the queue is full) and waits for its
        answer, until the batch's window ends."""
        gateway, admitter = self.app[GATEWAY], self.app[ADMITTER]
        info = gateway.directory.models.get(plan.job.model)
        deadline = time.monotonic() + batch.expires_at - time.time()
        keep = functools.partial(keep_turn, self.app[STORE], self.app[CONVERSATIONS], caller.tenant)
        while True:
            await admitter.admit_batch(caller, plan.job, info.max_model_len if info else 0)
            queued = False
            try:
                async with gateway.submit(plan.job, deadline, None, on_refused=admitter.refund) as events:
                    queued = True
                    return await pump.answer(events, plan.renderer, plan.job.model, keep)
            except (Overloaded, RateLimited) as exc:
                if queued or isinstance(exc, QuotaExceeded) or time.monotonic() + QUEUE_RETRY_S >= deadline:
                    raise
            await asyncio.sleep(QUEUE_RETRY_S)

    async def _end(self, batch: Batch, lines: list[BatchLine], how: str) -> None:
        """Writes the answers into the output and error files and ends the batch as `how` says."""
        now = int(time.time())
        if how == "expired":
            await self._expire_rest(batch, lines)
        if batch.status != "failed":
            batch.status, batch.finalizing_at = "finalizing", now
            await self.store.update(self.tenant, batch)
        batch.output_file_id, batch.error_file_id = await self._files(batch, lines)
        match how:
            case "completed":
                batch.status, batch.completed_at = "completed", now
            case "expired":
                batch.status, batch.expired_at = "expired", now
            case "cancelled":
                batch.status, batch.cancelled_at = "cancelled", now
            case "storage_full":
                failed_with(batch, [BatchError(
                    code="storage_quota_exceeded", message="The batch's answers filled your storage: the lines "
                    "answered so far are in its files, the rest did not run.")])
            case "invalid_key":
                failed_with(batch, [BatchError(
                    code="invalid_key", message="The API key of the batch was revoked or has expired: the lines "
                    "answered so far are in its files, the rest did not run.")])
        await self.store.settle(self.tenant, batch)
        metrics.BATCHES.labels(batch.status).inc()

    async def _expire_rest(self, batch: Batch, lines: list[BatchLine]) -> None:
        answered = await self.store.answered_ids(self.tenant, batch.id)
        for index, line in enumerate(lines):
            if line.custom_id not in answered:
                await self.store.answer(self.tenant, batch, line.custom_id, shapes.unrun(
                    f"{batch.id}_{index}", line.custom_id, "batch_expired",
                    "This request could not be executed before the completion window expired."), False, (0, 0))
                metrics.BATCH_LINES.labels(batch.endpoint, "expired").inc()

    async def _files(self, batch: Batch, lines: list[BatchLine]) -> tuple[str | None, str | None]:
        """Writes the answers into the output and error files (ids), in the input's order, ANSWERS_READ answers
        at a time: the answers may come to the tenant's whole storage quota, and the files are written as they are
        read (see FileWriter)."""
        output, errors = await self._writer(batch, "output"), await self._writer(batch, "error")
        writers = {b"o": output, b"e": errors}
        for start in range(0, len(lines), ANSWERS_READ):
            page = [line.custom_id for line in lines[start:start + ANSWERS_READ]]
            for answer in await self.store.answers(self.tenant, batch.id, page):
                if answer and isinstance(writer := writers.get(answer[:1]), FileWriter):
                    await writer.add(answer[1:] + b"\n")
        return await _sealed(output), await _sealed(errors)

    async def _writer(self, batch: Batch, kind: str) -> FileWriter | str:
        """The writer of one of the batch's files, or its id when it is stored already (a driver that died
        finalizing stored it); its bytes take the place of the answers' in the tenant's storage, so no quota
        refuses it."""
        file_id = f"file-{batch.id.removeprefix('batch_')}-{kind}"
        files = self.app[FILES]
        with contextlib.suppress(TokenbusError):
            return (await files.info(self.tenant, file_id)).id
        return files.writer(self.tenant, FileInfo(id=file_id, bytes=0, created_at=int(time.time()),
                                                  filename=f"{batch.id}_{kind}.jsonl", purpose=f"batch_{kind}"))


async def _sealed(file: FileWriter | str) -> str | None:
    if isinstance(file, str):
        return file
    info = await file.seal()
    return None if info is None else info.id


@contextlib.asynccontextmanager
async def _watching(run: BatchRun, batch: Batch) -> AsyncIterator[None]:
    watcher = asyncio.create_task(run.watch(batch))
    try:
        yield
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


def _invalid(batch: Batch, lines: list[BatchLine]) -> list[BatchError]:
    """What makes a batch fail before it runs: a line for another endpoint, or an embeddings batch with more
    inputs than OpenAI allows."""
    errors = [BatchError(code="invalid_url", message=f"The line's url {line.url} is not the batch's "
                                f"endpoint {batch.endpoint}.", param="url", line=number)
              for number, line in enumerate(lines, start=1) if line.url != batch.endpoint][:100]
    if batch.endpoint == "/v1/embeddings":
        inputs = sum(line.inputs() for line in lines)
        if inputs > MAX_EMBEDDING_INPUTS:
            errors.append(BatchError(code="too_many_inputs", message=f"An embeddings batch takes at most "
                                            f"{MAX_EMBEDDING_INPUTS} inputs in all; this one has {inputs}."))
    return errors


def add_to(app: web.Application) -> None:
    app.on_shutdown.append(_stop_driving)


async def _stop_driving(app: web.Application) -> None:
    await app[BATCH_DRIVER].stop()

