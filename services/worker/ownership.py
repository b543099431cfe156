"""Who owns which job: a worker keeps its claims fresh, takes over the entries of dead workers (XAUTOCLAIM
past an idle time tied to the heartbeat TTL; on workers' own streams, moved back to the model's stream), forgets
dead consumers, and reads what a former owner left in a job's log so that the job continues after the last event
its client can have.

An entry's idle time restarts whenever its owner refreshes it (every heartbeat), so only the entries of a
worker that stopped beating grow idle enough to be claimed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from services.worker.jobtable import Run
from shared.protocol import bus, joblog, keys, prefixes
from shared.protocol.sequence import in_order
from shared.redisio.rawpipe import PipelineLike, field_map
from shared.tenancy import fairshare
from shared.tenancy.fairshare_lua import HAND_OVER, RESCUE

log = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_KEEP_S = 7 * 24 * 3600
"""How long a dead letter (the whole job, its prompt included) is kept for an operator to look into: entries older
go at the next dead letter, and the stream itself this long after its latest."""

# Refreshes the idle time of the entries the caller still owns, and names those it lost (claimed by another
# worker after it stalled): one round trip, and no window in which a check and a claim could disagree.
_REFRESH = """
local lost = {}
for i = 3, #ARGV do
  local entry = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if entry[1] and entry[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""


@dataclass(frozen=True)
class Takeover:
    """What a new owner needs before it runs a job that someone else began."""

    epoch: int
    next_seq: int
    continuation: bus.Continuation | None
    ended: bool
    """The log already holds the job's last event: nothing is left to run."""
    conflict: bool
    """The log cannot be continued faithfully (trimmed, or written by two owners at once)."""
    cancelled: bool
    reclaims: int
    reply_to: str


class Ownership:
    """The ownership side of one worker of one model's queue."""

    def __init__(self, redis: aioredis.Redis, worker_id: str, model: str, stream: str, group: str,
                 aware: bool = True) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.model = model
        self.stream = stream
        self.own = keys.worker_requests(model, worker_id)
        """This worker's own stream (cache-aware dispatch)."""
        self.group = group
        self.aware = aware
        """Whether a job handed over goes to a worker holding its prompt's prefix, when one has room."""
        self._refresh = redis.register_script(_REFRESH)
        self._hand_over = redis.register_script(HAND_OVER)
        self._rescue = redis.register_script(RESCUE)

    def stream_of(self, run: Run) -> str:
        """The stream a run's entry is on."""
        return run.stream or self.stream

    @staticmethod
    def by_stream(runs: list[Run]) -> dict[str, list[Run]]:
        """Runs grouped by the stream of their entries ("": the model's)."""
        grouped: dict[str, list[Run]] = {}
        for run in runs:
            grouped.setdefault(run.stream, []).append(run)
        return grouped

    def read_refresh(self, pipe: PipelineLike, runs: list[Run]) -> None:
        """Adds to a pipeline the refresh of these runs' entries (their idle time restarts while they are ours), one
        command per stream of `by_stream`; `lost` takes their replies."""
        for stream, on_it in self.by_stream(runs).items():
            pipe.execute_command("EVALSHA", self._refresh.sha, 1, stream or self.stream, self.group, self.worker_id,
                                 *[run.entry_id for run in on_it])

    async def lost(self, replies: list[Any], runs: list[Run]) -> list[Run]:
        """The runs whose entries another worker has taken, from the replies of `read_refresh`; a Redis that lost
        the script runs it again, loading it."""
        taken: list[Run] = []
        for reply, (stream, on_it) in zip(replies, self.by_stream(runs).items(), strict=True):
            entry_ids = [run.entry_id for run in on_it]
            if isinstance(reply, NoScriptError):
                reply = await self._refresh(keys=[stream or self.stream], args=[self.group, self.worker_id, *entry_ids])
            elif isinstance(reply, Exception):
                raise reply
            gone = {bytes(entry) for entry in reply or ()}
            taken += [run for run in on_it if run.entry_id in gone]
        return taken

    def read_rescue(self, pipe: PipelineLike, min_idle_ms: int) -> None:
        """Adds to a pipeline the move of the jobs left on other workers' own streams (theirs stopped beating, or
        they stopped offering slots) back to the model's stream, where any worker takes them."""
        script_keys = keys.fair_keys(self.model)
        pipe.execute_command("EVALSHA", self._rescue.sha, len(script_keys), *script_keys,
                             keys.worker_streams(self.model), self.worker_id, min_idle_ms)

    async def rescue(self, min_idle_ms: int) -> int:
        """The same on its own (a stopping worker's unread jobs go back at once); returns the entries moved."""
        return int(await self._rescue(keys=keys.fair_keys(self.model),
                                      args=[keys.worker_streams(self.model), self.worker_id, min_idle_ms]))

    async def register(self) -> None:
        """Makes this worker's own stream, with the workers' group, and names it where rescues look."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xgroup_create(self.own, self.group, id="0", mkstream=True)
        pipe.sadd(keys.worker_streams(self.model), self.worker_id)
        replies = await pipe.execute(raise_on_error=False)
        if isinstance(replies[0], Exception) and "BUSYGROUP" not in str(replies[0]):
            raise replies[0]
        if isinstance(replies[1], Exception):
            raise replies[1]

    def read_claim(self, pipe: PipelineLike, min_idle_ms: int, count: int) -> None:
        """Adds to a pipeline a claim of up to `count` entries idle longer than `min_idle_ms` (their owners
        stopped beating); `claimed` takes its reply."""
        pipe.execute_command("XAUTOCLAIM", self.stream, self.group, self.worker_id, min_idle_ms, "0-0",
                             "COUNT", count)

    @staticmethod
    def claimed(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The entries a claim took, with their fields (entries deleted meanwhile left out)."""
        if isinstance(reply, Exception):
            raise reply
        return [(entry_id, field_map(fields)) for entry_id, fields in reply[1] if fields]

    async def forget_dead_consumers(self) -> list[str]:
        """Removes consumers with nothing pending whose worker's heartbeat is gone."""
        consumers: Any = await self.redis.xinfo_consumers(self.stream, self.group)
        idle = [c["name"] for c in consumers if not c["pending"]]
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in idle]
        names = [n for n in names if n != self.worker_id]
        if not names:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(keys.worker_heartbeat(self.model, name))
        alive = await pipe.execute()
        dead = [name for name, beating in zip(names, alive, strict=True) if not beating]
        for name in dead:
            await self.redis.xgroup_delconsumer(self.stream, self.group, name)
        return dead

    async def take_over(self, job: bus.Job, reclaimed: bool, keep_s: float) -> Takeover:
        """Reads the job's log and counters in one round trip and becomes its next owner (a higher epoch)."""
        owners = keys.job_owners(job.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(keys.job_log(job.id))
        pipe.exists(keys.cancelled(job.id))
        pipe.get(keys.job_reply_to(job.id))
        pipe.hincrby(owners, "epoch", 1)
        pipe.hincrby(owners, "reclaims", 1 if reclaimed else 0)
        pipe.expire(owners, int(keep_s) + 1)
        entries, cancelled, reply_to, epoch, reclaims, _ = await pipe.execute()
        taken, conflict = in_order(joblog.parse(entries))
        return Takeover(
            epoch=int(epoch) + 1, next_seq=len(taken), continuation=continuation_of(job, taken) if taken else None,
            ended=any(isinstance(e, bus.Final | bus.Error) for e in taken), conflict=conflict,
            cancelled=bool(cancelled), reclaims=int(reclaims),
            reply_to=reply_to.decode() if reply_to else job.reply_to,
        )

    async def dead_letter(self, run: Run, reason: str) -> None:
        """Moves a job off the queue into the dead-letter stream, with why (kept DEAD_LETTER_KEEP_S)."""
        stream, letters = self.stream_of(run), keys.dead_letters(self.model)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(letters, {"job": bus.encode_job(run.job), "reason": reason, "entry": run.entry_id,
                            "worker": self.worker_id}, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        pipe.xtrim(letters, minid=(bus.now_ms() - DEAD_LETTER_KEEP_S * 1000), approximate=True)
        pipe.expire(letters, DEAD_LETTER_KEEP_S)
        pipe.xack(stream, self.group, run.entry_id)
        pipe.xdel(stream, run.entry_id)
        await pipe.execute()

    async def hand_over(self, run: Run) -> fairshare.Dispatched | None:
        """Puts the job back on the queue for another worker to continue (one holding its prompt's prefix, when
        one has room), and lets go of its entry, at once; what the scheduler charged for it goes on its new entry
        too, settled by whoever ends it. Returns where it went, as placements; None when another worker had claimed
        its entry meanwhile (it continues the job: handing it over as well would give it two owners)."""
        moved = msgspec.structs.replace(run.job, handovers=run.job.handovers + 1, continuation=None)
        entry: dict[Any, Any] = {**(run.ticket.fields() if run.ticket else {}), bus.JOB_FIELD: bus.encode_job(moved)}
        placed = await self._requeue(self.stream_of(run), run.entry_id, entry, run.job)
        return None if placed is None else fairshare.Dispatched(0, tuple(int(n) for n in placed))

    async def give_back(self, entry_id: Any, fields: dict[Any, Any], job: bus.Job | None) -> None:
        """Puts an entry of the model's stream that this worker read without a slot for it back on the queue, as
        it was (placed by its job's prefix like a dispatched job), and lets go of it, in one step."""
        await self._requeue(self.stream, entry_id, fields, job)

    async def _requeue(self, stream: str, entry_id: Any, fields: dict[Any, Any],
                       job: bus.Job | None) -> list[Any] | None:
        """A new entry of `fields` on the queue (the own stream of a live worker with room that holds the job's
        prefix, else as a dispatch places it), and the old one let go of, in one script; its placements (None, and
        nothing done, when the old entry is no longer this worker's)."""
        chain = prefixes.chain(job) if job and self.aware else []
        affinity = f"0 {' '.join(chain)}" if chain else ""
        flat = [part for pair in fields.items() for part in pair]
        placed: list[Any] | None = await self._hand_over(keys=keys.fair_keys(self.model),
                                                         args=[stream, entry_id, affinity, self.worker_id, *flat])
        return placed


def continuation_of(job: bus.Job, taken: list[bus.Event]) -> bus.Continuation:
    """What the client can already have of the job, from the events its log holds."""
    choices = max(1, len(job.prompts)) * job.params.n
    token_ids: list[list[int]] = [[] for _ in range(choices)]
    texts: list[list[str]] = [[] for _ in range(choices)]
    calls: list[list[bus.ToolCall]] = [[] for _ in range(choices)]
    reasonings: list[list[str]] = [[] for _ in range(choices)]
    finished = [False] * choices
    result = bus.Continuation(token_ids=token_ids, finished=finished, calls=calls)
    for event in taken:
        if isinstance(event, bus.Tokens) and event.choice < choices:
            token_ids[event.choice].extend(event.token_ids)
            texts[event.choice].append(event.text)
            reasonings[event.choice].append(event.reasoning)
            bus.add_call_deltas(calls[event.choice], event.tool_calls)
            finished[event.choice] = finished[event.choice] or event.finish_reason is not None
        elif isinstance(event, bus.Prompt):
            result.prompted.append(event.index)
        elif isinstance(event, bus.Embedding):
            result.embedded.append(event.index)
    result.texts = ["".join(parts) for parts in texts]
    result.reasonings = ["".join(parts) for parts in reasonings]
    return result
