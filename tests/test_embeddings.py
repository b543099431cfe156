"""Embeddings through the whole path: a pooling worker on all-MiniLM-L6-v2, the openai SDK, three routes."""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.openapi import validate
from tests.processes import EMBEDDING_MODEL, MODEL, Edge, WorkerProcess

pytestmark = pytest.mark.engine


@pytest.fixture
async def embed_client(served: Edge, embedder: WorkerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def test_related_sentences_are_closer(embed_client: openai.AsyncOpenAI) -> None:
    reply = await embed_client.embeddings.create(model=EMBEDDING_MODEL, input=[
        "A man is playing a guitar.", "Someone strums an acoustic guitar.", "The stock market fell sharply today.",
    ])
    assert reply.object == "list" and reply.model == EMBEDDING_MODEL
    assert [d.index for d in reply.data] == [0, 1, 2] and all(d.object == "embedding" for d in reply.data)
    guitar, strum, stocks = (d.embedding for d in reply.data)
    assert len(guitar) == 384
    assert cosine(guitar, strum) > cosine(guitar, stocks) + 0.2
    assert reply.usage.prompt_tokens > 10 and reply.usage.total_tokens == reply.usage.prompt_tokens


async def test_hello_world_matches_the_reference_vector(embed_client: openai.AsyncOpenAI) -> None:
    reply = await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="hello world")
    # sentence-transformers' own all-MiniLM-L6-v2 output for "hello world" starts with these values
    assert reply.data[0].embedding[:3] == pytest.approx([-0.0345, 0.0310, 0.0067], abs=2e-4)


async def test_base64_decodes_to_the_same_floats(embed_client: openai.AsyncOpenAI, served: Edge) -> None:
    floats = (await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="hello world",
                                                   encoding_format="float")).data[0].embedding
    async with httpx.AsyncClient() as http:
        body = (await http.post(served.url + "/v1/embeddings", json={
            "model": EMBEDDING_MODEL, "input": "hello world", "encoding_format": "base64"})).json()
    decoded = array("f", base64.b64decode(body["data"][0]["embedding"])).tolist()
    assert decoded == pytest.approx(floats, abs=1e-7)
    sdk = await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="hello world", encoding_format="base64")
    assert isinstance(sdk.data[0].embedding, str) or sdk.data[0].embedding == pytest.approx(floats, abs=1e-7)


async def test_one_vector_through_three_routes(served: Edge, embedder: WorkerProcess) -> None:
    body = {"model": EMBEDDING_MODEL, "input": "The same sentence everywhere."}
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        v1 = (await http.post("/v1/embeddings", json=body)).json()
        v3 = (await http.post("/v3/embeddings", json=body)).json()
        databricks = (await http.post(f"/serving-endpoints/{EMBEDDING_MODEL}/invocations",
                                      json={"input": body["input"]})).json()
    validate("CreateEmbeddingResponse", v1)
    vectors = [r["data"][0]["embedding"] for r in (v1, v3, databricks)]
    assert vectors[0] == pytest.approx(vectors[1], abs=1e-6) == vectors[0]
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-6)


async def test_instruction_is_prepended(embed_client: openai.AsyncOpenAI) -> None:
    plain = await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="query: cats")
    instructed = await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="cats",
                                                      extra_body={"instruction": "query: "})
    assert instructed.data[0].embedding == pytest.approx(plain.data[0].embedding, abs=1e-6)


async def test_dimensions_the_model_cannot_give_are_refused(embed_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="x", dimensions=128)
    assert caught.value.body["param"] == "dimensions"
    same = await embed_client.embeddings.create(model=EMBEDDING_MODEL, input="x", dimensions=384)
    assert len(same.data[0].embedding) == 384


async def test_models_of_the_wrong_task_are_refused(embed_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await embed_client.embeddings.create(model=MODEL, input="x")
    assert caught.value.body["code"] == "wrong_model_task"
    with pytest.raises(openai.BadRequestError):
        await embed_client.chat.completions.create(model=EMBEDDING_MODEL, messages=[{"role": "user", "content": "x"}])
