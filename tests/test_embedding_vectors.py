"""What an embeddings request makes the bus, the worker and the edge carry, checked without an engine: its vectors
(inputs x the model's dimensions) are bounded at the edge and again at the worker."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import orjson
import pytest

from services.edge.formats import planners
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
    """2,048 inputs of MiniLM's 384 dimensions are served, and 244 of a 4,096-dimension model; 245 of those (which
    would be 1,003,520 values) are refused with a 400 naming `input` before anything is queued, in base64 too."""
    assert len(plan({"model": "m", "input": ["x"] * 2048}, 384).job.prompts) == 2048
    assert len(plan({"model": "m", "input": ["x"] * 244, "dimensions": 4096}, 4096).job.prompts) == 244
    for extra in ({}, {"encoding_format": "base64"}, {"dimensions": 4096}):
        with pytest.raises(InvalidRequest) as refused:
            plan({"model": "m", "input": ["x"] * 245, **extra}, 4096)
        assert refused.value.status == 400 and refused.value.param == "input"
        assert "at most 244 inputs" in refused.value.message
        error = orjson.loads(msgspec.json.encode(openai_error_body(refused.value)))["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "input"
    with pytest.raises(InvalidRequest) as shortened:  # `dimensions` names the model's own, or is refused first
        plan({"model": "m", "input": ["x"] * 245, "dimensions": 256}, 4096)
    assert shortened.value.param == "dimensions"
    assert len(plan({"model": "m", "input": ["x"] * 976}, 1024).job.prompts) == 976  # bge-large, e5-large


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
    assert refused.value.param == "input" and "at most 244 inputs" in refused.value.message

