"""Migration with the real vLLM worker: a job whose owner died after part of its answer continues from its log.

Only one vLLM engine fits this machine, so the dead owner is played by its log: the first half of an
uninterrupted greedy answer, written as the owner would have written it. The real worker takes the job over
(as it does a job handed over by a draining worker), and the whole answer must equal the uninterrupted one.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from shared.protocol import bus, keys
from tests.channel import listening
from tests.processes import MODEL, WorkerProcess

pytestmark = pytest.mark.engine

COUNTING = [bus.Message(role="user", content="Count from 1 to 30, separated by commas.")]


def _job(reply_to: str, *, n: int = 1, handovers: int = 0) -> bus.Job:
    return bus.Job(id=f"test-{uuid.uuid4().hex}", model=MODEL, reply_to=reply_to, deadline_ms=bus.now_ms() + 60_000,
                   messages=COUNTING, params=bus.SamplingParams(max_tokens=40, temperature=0, n=n),
                   created_ms=bus.now_ms(), handovers=handovers)


def _run(redis_client: redis.Redis, job: bus.Job) -> list[bus.Event]:
    """Enqueues the job and returns the events published for it, up to the last one."""
    with listening(redis_client, job.reply_to) as listener:
        redis_client.xadd(keys.requests_stream(MODEL), {bus.JOB_FIELD: bus.encode_job(job)})
        events = [e for _t, e in listener.events(wait_s=60)]
    assert events and isinstance(events[-1], bus.Final | bus.Error), events
    return events


def _text(events: list[bus.Event], choice: int = 0) -> str:
    return "".join(e.text for e in events if isinstance(e, bus.Tokens) and e.choice == choice)


def test_a_job_continues_after_what_its_former_owner_sent(redis_client: redis.Redis, worker: WorkerProcess) -> None:
    stream = keys.events_channel(f"test-{uuid.uuid4().hex}")
    whole = _run(redis_client, _job(stream))
    tokens = [e for e in whole if isinstance(e, bus.Tokens)]
    final = whole[-1]
    assert isinstance(final, bus.Final) and len(tokens) > 10

    job = _job(keys.events_channel(f"test-{uuid.uuid4().hex}"), handovers=1)
    former: list[bus.Event] = [bus.Started(job=job.id, worker="a-dead-worker", seq=0, epoch=1)]
    former += [bus.Tokens(job=job.id, text=t.text, token_ids=t.token_ids, seq=i + 1, epoch=1)
               for i, t in enumerate(tokens[: len(tokens) // 2])]
    redis_client.xadd(keys.job_log(job.id), {bus.EVENTS_FIELD: bus.encode_events(former)})
    rest = _run(redis_client, job)

    started = rest[0]
    assert isinstance(started, bus.Started) and started.resumed
    assert (started.seq, started.epoch) == (len(former), 2)
    assert [e.seq for e in rest] == list(range(len(former), len(former) + len(rest)))
    assert _text(former) + _text(rest) == _text(whole)
    continued = rest[-1]
    assert isinstance(continued, bus.Final)
    assert (continued.prompt_tokens, continued.completion_tokens) == (final.prompt_tokens, final.completion_tokens)


def test_a_job_whose_former_owner_sent_every_token_but_not_its_end_ends_as_a_length_stop(
        redis_client: redis.Redis, worker: WorkerProcess) -> None:
    """The former owner wrote the job's last token and died before its ending: nothing is left to generate (vLLM
    refuses max_tokens 0), so the new owner ends the choice as a length stop (it failed as an invalid request)."""
    whole = _run(redis_client, _job(keys.events_channel(f"test-{uuid.uuid4().hex}")))
    tokens = [e for e in whole if isinstance(e, bus.Tokens)]
    assert tokens[-1].finish_reason == "length"
    job = _job(keys.events_channel(f"test-{uuid.uuid4().hex}"), handovers=1)
    former: list[bus.Event] = [bus.Started(job=job.id, worker="a-dead-worker", seq=0, epoch=1)]
    former += [bus.Tokens(job=job.id, text=t.text, token_ids=t.token_ids, seq=i + 1, epoch=1)
               for i, t in enumerate(tokens)]  # every token, the last one without its finish_reason
    redis_client.xadd(keys.job_log(job.id), {bus.EVENTS_FIELD: bus.encode_events(former)})
    rest = _run(redis_client, job)
    assert not any(isinstance(e, bus.Error) for e in rest), rest
    ended = [e for e in rest if isinstance(e, bus.Tokens)]
    assert [(e.text, e.finish_reason) for e in ended] == [("", "length")]
    assert _text(former) == _text(whole)
