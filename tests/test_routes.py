"""Databricks serving endpoints, OVMS /v3 aliases and the generated OpenAPI document."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.edge.routes import api_document as document
from tests.openapi import sse_events, validate
from tests.processes import MODEL, Edge

pytestmark = pytest.mark.engine

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


async def test_databricks_chat_and_completions(served: Edge) -> None:
    url = f"{served.url}/serving-endpoints/{MODEL}/invocations"
    async with httpx.AsyncClient(timeout=60) as http:
        chat = (await http.post(url, json={"messages": FRANCE, "temperature": 0, "max_tokens": 20})).json()
        completion = (await http.post(url, json={"prompt": "What is the capital of France?", "temperature": 0,
                                                  "max_tokens": 20})).json()
        missing = await http.post(f"{served.url}/serving-endpoints/nope/invocations", json={"messages": FRANCE})
    validate("CreateChatCompletionResponse", chat)
    assert "Paris" in chat["choices"][0]["message"]["content"]
    # Databricks applies the chat template to completion prompts unless use_raw_prompt is true
    assert "Paris" in completion["choices"][0]["text"]
    assert completion["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert missing.status_code == 404


async def test_databricks_streams_chat(served: Edge) -> None:
    events = await sse_events(f"{served.url}/serving-endpoints/{MODEL}/invocations",
                              {"messages": FRANCE, "temperature": 0, "max_tokens": 20, "stream": True})
    assert events[-1] == (None, "[DONE]")
    text = "".join(d["choices"][0]["delta"].get("content", "") for _n, d in events[:-1] if d["choices"])
    assert "Paris" in text


async def test_v3_aliases_answer_like_v1(served: Edge) -> None:
    async with openai.AsyncOpenAI(base_url=served.url + "/v3", api_key="unused", max_retries=0) as v3:
        models = [m.id async for m in v3.models.list()]
        chat = await v3.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
        completion = await v3.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                 temperature=0)
        response = await v3.responses.create(model=MODEL, input="What is the capital of France?", temperature=0)
        again = await v3.responses.retrieve(response.id)
    assert MODEL in models
    assert "Paris" in (chat.choices[0].message.content or "")
    assert "Paris" in completion.choices[0].text
    assert again.output_text == response.output_text and "Paris" in response.output_text


async def test_openapi_document_describes_every_route(served: Edge) -> None:
    async with httpx.AsyncClient() as http:
        served_doc = (await http.get(served.url + "/openapi.json")).json()
    assert served_doc["openapi"].startswith("3.1")
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v3/chat/completions",
                 "/serving-endpoints/{name}/invocations", "/generate", "/generate_stream", "/", "/info",
                 "/v1/messages", "/v1/messages/count_tokens"]:
        assert path in served_doc["paths"], path
    chat_schema = served_doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat_schema["properties"]["temperature"]["anyOf"][0]["maximum"] == 2
    assert set(chat_schema["required"]) == {"model", "messages"}
    messages_schema = served_doc["components"]["schemas"]["MessagesRequest"]
    assert set(messages_schema["required"]) == {"model", "messages", "max_tokens"}


def test_openapi_document_is_valid_openapi() -> None:
    import json
    import re

    from jsonschema import Draft202012Validator

    doc = json.loads(document())
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs == set(schemas), "every $ref names a component schema, and every component schema is used"
