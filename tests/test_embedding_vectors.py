"""What an embeddings request makes the bus, the worker and the edge carry, checked without an engine: its vectors
(inputs x the model's dimensions) are bounded at the edge and again at the worker, and they cross the bus as
float32 bytes where the edge asked for them, read as the float lists of a worker of an earlier version."""

from __future__ import annotations

import asyncio
import base64
import math
from array import array
from types import SimpleNamespace
from typing import Any

import msgspec
import orjson
import pytest

from services.edge.formats import embeddings, planners, rerank
from services.edge.formats.base import openai_error_body
from services.worker import pooling
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest


def plan(body: dict[str, Any], dimensions: int, task: str = "embed") -> planners.Planned:
    """Plans a request against a worker of `dimensions`, as the edge does (planners.advance)."""
    path = body.pop("_path", "embeddings")
    planning = getattr(planners, f"plan_{path}")(orjson.dumps(body))
    step = planners.advance(planning)
    while not isinstance(step, planners.Planned):
        answer: object = None
        if isinstance(step, planners.Model):
            answer = bus.WorkerInfo(worker="w", model="m", task=task, dimensions=dimensions)
        elif isinstance(step, planners.Arrive):
            answer = planners.Arrival(job_id="j", started=0.0, deadline_ms=1, reply_to="r", created=0)
        step = planners.advance(planning, answer)
    return step


def test_the_vectors_a_request_may_ask_for_are_bounded_by_the_model_s_dimensions() -> None:
    """2,048 inputs of MiniLM's 384 dimensions are served, and 512 of a 4,096-dimension model; 513 of those (which
    would be 2,101,248 values) are refused with a 400 naming `input` before anything is queued, in base64 too."""
    assert len(plan({"model": "m", "input": ["x"] * 2048}, 384).job.prompts) == 2048
    assert len(plan({"model": "m", "input": ["x"] * 512, "dimensions": 4096}, 4096).job.prompts) == 512
    for extra in ({}, {"encoding_format": "base64"}, {"dimensions": 4096}):
        with pytest.raises(InvalidRequest) as refused:
            plan({"model": "m", "input": ["x"] * 513, **extra}, 4096)
        assert refused.value.status == 400 and refused.value.param == "input"
        assert "at most 512 inputs" in refused.value.message
        error = orjson.loads(msgspec.json.encode(openai_error_body(refused.value)))["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "input"
    with pytest.raises(InvalidRequest) as shortened:  # `dimensions` names the model's own, or is refused first
        plan({"model": "m", "input": ["x"] * 513, "dimensions": 256}, 4096)
    assert shortened.value.param == "dimensions"
    assert len(plan({"model": "m", "input": ["x"] * 2048}, 1024).job.prompts) == 2048  # bge-large, e5-large
    assert len(plan({"model": "m", "input": ["x"] * 1000}, 2048).job.prompts) == 1000  # a client's usual batch


def test_the_worker_refuses_what_an_older_edge_let_through_before_it_computes() -> None:
    class Engine:
        dimensions = 4096
        max_model_len = 512

        async def prompt_ids(self, job: bus.Job) -> list[list[int]]:
            raise AssertionError("tokenized")

    job = bus.Job(id="j", model="m", reply_to="r", deadline_ms=1, kind="embedding", prompts=["x"] * 2048)

    async def first() -> Any:
        return await anext(aiter(pooling.embed(Engine(), job, 0)))

    with pytest.raises(InvalidRequest) as refused:
        asyncio.run(first())
    assert refused.value.param == "input" and "at most 512 inputs" in refused.value.message


def vectors(count: int, dimensions: int) -> list[list[float]]:
    """Float32 values (what the engine's tensors hold), as Python floats."""
    return [array("f", [math.sin(i * 7 + d) / (d + 1) for d in range(dimensions)]).tolist() for i in range(count)]


def answer(events: list[bus.Event], encoding_format: str) -> Any:
    req = msgspec.json.decode(orjson.dumps({"model": "m", "input": ["x"] * 3, "encoding_format": encoding_format}),
                              type=embeddings.EmbeddingRequest)
    renderer = embeddings.EmbeddingRenderer(req, "id")
    for event in bus.decode_events(bus.encode_events(events)):
        assert isinstance(event, (bus.Embedding, bus.Final))
        renderer.render(event)
    return orjson.loads(msgspec.json.encode(renderer.body()))


def test_packed_vectors_answer_as_float_lists_did_in_both_encodings() -> None:
    """A worker that knows packed vectors and one of an earlier version (float lists) give the same answers; the
    base64 one is OpenAI's (the float32 values, little-endian), made from the packed bytes as they came."""
    values = vectors(3, 384)
    final = bus.Final(job="j", prompt_tokens=3, completion_tokens=0)
    listed: list[bus.Event] = [bus.Embedding(job="j", index=i, vector=v, prompt_tokens=1) for i, v in enumerate(values)]
    packed: list[bus.Event] = [bus.Embedding(job="j", index=i, packed=bus.pack_vector(v), prompt_tokens=1)
                               for i, v in enumerate(values)]
    for encoding_format in ("float", "base64"):
        assert answer([*packed, final], encoding_format) == answer([*listed, final], encoding_format)
    assert [d["embedding"] for d in answer([*packed, final], "float")["data"]] == values
    first = base64.b64decode(answer([*packed, final], "base64")["data"][0]["embedding"])
    assert first == array("f", values[0]).tobytes() and len(first) == 4 * 384


def test_a_request_s_vectors_take_half_the_bus_they_took() -> None:
    """512 vectors of 4,096 dimensions (the most one request may ask for): about 8 MB on the bus as float32, not
    the 19 MB of msgpack float64 lists, well under what Redis lets one publish to an edge's subscription."""
    values = vectors(1, 4096)[0]
    packed = bus.encode_events([bus.Embedding(job="j", index=i, packed=bus.pack_vector(values), prompt_tokens=1)
                                for i in range(512)])
    listed = bus.encode_events([bus.Embedding(job="j", index=i, vector=values, prompt_tokens=1) for i in range(512)])
    assert len(packed) < 512 * 4096 * 4 * 1.01 < len(listed) / 2


def test_the_edge_asks_for_packed_vectors_of_embedding_models_only() -> None:
    assert plan({"model": "m", "input": "x"}, 384).job.packed_vectors
    ranked = {"_path": "rerank", "model": "m", "query": "q", "documents": ["a", "b"]}
    assert plan(dict(ranked), 384).job.packed_vectors
    assert not plan(dict(ranked), 0, task="score").job.packed_vectors  # a cross-encoder's scores stay float64


def test_scores_of_packed_vectors_are_the_cosines_of_their_values() -> None:
    values = vectors(3, 64)
    scores = rerank.PairScores([(0, 1), (0, 2)], cross=False)
    for i, v in enumerate(values):
        scores.render(bus.Embedding(job="j", index=i, packed=bus.pack_vector(v), prompt_tokens=1))
    assert scores.scores() == [rerank.cosine(values[0], values[1]), rerank.cosine(values[0], values[2])]


class OldEmbedding(msgspec.Struct, tag="emb", kw_only=True, omit_defaults=True):
    """bus.Embedding as the previous version has it: `vector` required, no `packed`."""

    job: str
    seq: int = 0
    epoch: int = 0
    index: int
    vector: list[float]
    prompt_tokens: int


class OldJob(msgspec.Struct, omit_defaults=True):
    id: str
    model: str
    reply_to: str
    deadline_ms: int
    kind: str = "chat"
    prompts: list[str] = []


@pytest.mark.parametrize("packed_vectors", [False, True])
def test_a_worker_packs_vectors_only_for_a_job_that_asks(monkeypatch: pytest.MonkeyPatch,
                                                         packed_vectors: bool) -> None:
    """A job from an edge of an earlier version (no packed_vectors, which an older worker ignores) gets the float
    lists that edge reads; a new edge reads both, so neither upgrade order answers wrongly."""
    torch = pytest.importorskip("torch")
    data = torch.tensor([0.25, -1.5, 3.0], dtype=torch.float32)
    done = SimpleNamespace(finished=True, outputs=SimpleNamespace(data=data))

    class Llm:
        async def encode(self, *args: Any, **kwargs: Any) -> Any:
            yield done

    monkeypatch.setattr(pooling, "engine_prompt", lambda ids, arrival, salt: ids)
    job = bus.Job(id="j", model="m", reply_to="r", deadline_ms=1, kind="embedding", prompts=["x"],
                  packed_vectors=packed_vectors)
    assert msgspec.msgpack.decode(bus.encode_job(job), type=OldJob).prompts == ["x"]  # an older worker takes it

    async def run() -> list[bus.Output]:
        engine = SimpleNamespace(llm=Llm())
        return [e async for e in pooling._one(engine, job, "j-0", 0, [1, 2], None, 0, 0.0)]

    [event] = asyncio.run(run())
    assert isinstance(event, bus.Embedding) and event.values() == [0.25, -1.5, 3.0]
    wire = bus.encode_events([event])
    assert bus.decode_events(wire) == [event]
    if packed_vectors:
        assert event.packed == array("f", [0.25, -1.5, 3.0]).tobytes() and not event.vector
    else:
        assert msgspec.msgpack.decode(wire, type=list[OldEmbedding])[0].vector == [0.25, -1.5, 3.0]
        assert not event.packed
    older = msgspec.msgpack.encode([OldEmbedding(job="j", index=0, vector=[0.5], prompt_tokens=1)])
    assert bus.decode_events(older)[0] == bus.Embedding(job="j", index=0, vector=[0.5], prompt_tokens=1)
