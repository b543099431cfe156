"""Rerank and score on the real embedding worker (all-MiniLM-L6-v2): Jina's and vLLM's `/v1/rerank`, Cohere's
`/v2/rerank`, OVMS's `/v3/rerank` and vLLM's `/v1/score` answer in their shapes, order a relevant document above
irrelevant ones, and score a pair as the cosine of the two vectors `/v1/embeddings` gives; on a real cross-encoder
worker (the score task) each pair is read together and scored as transformers scores it."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import SCORING_MODEL, scoring_model_dir
from tests.made_models import cross_encoder_scores
from tests.processes import EMBEDDING_MODEL, MODEL, Edge, WorkerProcess

pytestmark = pytest.mark.engine

QUERY = "What is the capital of France?"
DOCUMENTS: list[Any] = ["Bananas are yellow and sweet.", {"text": "Paris is the capital of France."},
                        "The stock market fell sharply today."]


@pytest.fixture
async def http(served: Edge, embedder: WorkerProcess) -> Any:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
        yield client


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def test_rerank_orders_the_relevant_document_first_on_every_route(http: httpx.AsyncClient) -> None:
    body = {"model": EMBEDDING_MODEL, "query": QUERY, "documents": DOCUMENTS}
    answer = (await http.post("/v1/rerank", json=body)).json()
    assert answer.keys() == {"id", "model", "usage", "results"} and answer["model"] == EMBEDDING_MODEL
    results = answer["results"]
    assert results[0]["index"] == 1 and sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[1] + 0.2
    assert results[0]["document"] == {"text": "Paris is the capital of France."}
    assert answer["usage"]["total_tokens"] > 10
    for path in ("/v2/rerank", "/v3/rerank"):
        again = (await http.post(path, json=body)).json()
        assert [(r["index"], round(r["relevance_score"], 5)) for r in again["results"]] == [
            (r["index"], round(r["relevance_score"], 5)) for r in results], path
    top = (await http.post("/v2/rerank", json={**body, "top_n": 1, "return_documents": False})).json()
    assert top["results"] == [{"index": 1, "relevance_score": results[0]["relevance_score"]}]


async def test_score_is_the_cosine_of_the_embeddings(http: httpx.AsyncClient, served: Edge) -> None:
    texts = ["Paris is the capital of France.", "Bananas are yellow and sweet."]
    answer = (await http.post("/v1/score", json={"model": EMBEDDING_MODEL, "text_1": QUERY, "text_2": texts})).json()
    assert answer["object"] == "list" and answer["model"] == EMBEDDING_MODEL
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(0, "score"), (1, "score")]
    relevant, irrelevant = (d["score"] for d in answer["data"])
    assert relevant > irrelevant + 0.2
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
        vectors = [d.embedding for d in (await client.embeddings.create(model=EMBEDDING_MODEL,
                                                                         input=[QUERY, *texts])).data]
    assert relevant == pytest.approx(cosine(vectors[0], vectors[1]), abs=1e-4)
    pairs = (await http.post("/v1/score", json={"model": EMBEDDING_MODEL, "text_1": [QUERY, QUERY],
                                                "text_2": texts})).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx([relevant, irrelevant], abs=1e-4)
    uneven = await http.post("/v1/score", json={"model": EMBEDDING_MODEL, "text_1": [QUERY, QUERY, QUERY],
                                                "text_2": texts})
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "text_2"


async def test_a_generation_model_does_not_rerank(http: httpx.AsyncClient) -> None:
    refused = await http.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": ["a"]})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_model_task"


async def test_a_cross_encoder_scores_each_pair_read_together_as_transformers_does(
        served: Edge, scorer: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every route on the cross-encoder: the scores are the model's own for each (query, document) pair (its token
    types included: the same texts scored apart, as cosines are, would differ), ranked best first."""
    documents = [d if isinstance(d, str) else d["text"] for d in DOCUMENTS]
    expected = cross_encoder_scores(scoring_model_dir(tmp_path_factory), [(QUERY, d) for d in documents])
    assert max(expected) - min(expected) > 0.05  # the head spreads them: an order to check
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        body = {"model": SCORING_MODEL, "query": QUERY, "documents": DOCUMENTS}
        for path in ("/v1/rerank", "/v2/rerank", "/v3/rerank"):
            answer = (await http.post(path, json=body)).json()
            ranked = sorted(range(len(documents)), key=lambda i: -expected[i])
            assert [r["index"] for r in answer["results"]] == ranked, path
            assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
                [expected[i] for i in ranked], abs=1e-4)
            assert answer["usage"]["total_tokens"] > 3 * len(QUERY.split())  # the query is read with each document
        scored = (await http.post("/v1/score", json={"model": SCORING_MODEL, "text_1": QUERY,
                                                     "text_2": documents})).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-4)
        pairwise = (await http.post("/v1/score", json={"model": SCORING_MODEL, "text_1": documents[::-1],
                                                       "text_2": [QUERY] * 3})).json()
        assert [d["score"] for d in pairwise["data"]] == pytest.approx(cross_encoder_scores(
            scoring_model_dir(tmp_path_factory), [(d, QUERY) for d in documents[::-1]]), abs=1e-4)
        refused = await http.post("/v1/embeddings", json={"model": SCORING_MODEL, "input": QUERY})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_model_task"
        models = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        assert models[SCORING_MODEL]["task"] == "score"


def test_the_scores_a_request_may_ask_for_are_bounded_by_the_model_s_dimensions() -> None:
    """The edge computes the scores on its loop: 1,000 documents of MiniLM's 384 dimensions are served, 600 of a
    4,096-dimension model are refused (a 400 naming `documents`) before anything is queued."""
    from services.edge.formats import planners
    from shared.protocol import bus
    from shared.protocol.errors import InvalidRequest

    def plan(documents: int, dimensions: int) -> bus.Job:
        body = orjson.dumps({"model": "m", "query": "q", "documents": ["d"] * documents})
        planning = planners.plan_rerank(body)
        step = planners.advance(planning)
        while not isinstance(step, planners.Planned):
            answer: object = None
            if isinstance(step, planners.Model):
                answer = bus.WorkerInfo(worker="w", model="m", task="embed" if dimensions else "score",
                                        dimensions=dimensions)
            elif isinstance(step, planners.Arrive):
                answer = planners.Arrival(job_id="j", started=0.0, deadline_ms=1, reply_to="r", created=0)
            step = planners.advance(planning, answer)
        return step.job

    assert len(plan(1000, 384).prompts) == 1001
    with pytest.raises(InvalidRequest) as refused:
        plan(600, 4096)
    assert refused.value.param == "documents" and refused.value.status == 400
    assert plan(1000, 0).pairs == [(0, 1 + i) for i in range(1000)]  # a cross-encoder's worker reads the pairs
    assert plan(1000, 0).sequences() == 1000


def test_what_a_cross_encoder_reads_is_bounded_before_it_is_queued() -> None:
    """A long query is read once per document: 1,000 documents under a 16 KiB query would make the worker read
    16 MiB; refused with a 400 naming `documents`, and the tokens a pair reads are what admission charges."""
    from services.edge.estimate import estimate
    from services.edge.formats import planners
    from shared.protocol import bus
    from shared.protocol.errors import InvalidRequest

    def plan(query: str, documents: int) -> bus.Job:
        planning = planners.plan_rerank(orjson.dumps({"model": "m", "query": query, "documents": ["d"] * documents}))
        step = planners.advance(planning)
        while not isinstance(step, planners.Planned):
            answer: object = None
            if isinstance(step, planners.Model):
                answer = bus.WorkerInfo(worker="w", model="m", task="score")
            elif isinstance(step, planners.Arrive):
                answer = planners.Arrival(job_id="j", started=0.0, deadline_ms=1, reply_to="r", created=0)
            step = planners.advance(planning, answer)
        return step.job

    job = plan("q" * 4000, 1000)
    assert estimate(job, 512)[0] >= 1000 * 1000  # 4,000 ASCII characters are 1,000 tokens, read 1,000 times
    with pytest.raises(InvalidRequest) as refused:
        plan("q" * 16384, 1000)
    assert refused.value.param == "documents"
