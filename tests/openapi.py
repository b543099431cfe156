"""Validates bodies and stream events against the official OpenAI and TGI OpenAPI schemas."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import httpx
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

REFERENCE = Path(__file__).resolve().parent / "reference"
"""Copies of the official OpenAI (openai/openai-openapi) and TGI (huggingface/text-generation-inference) schemas."""


def _nullable(node: Any) -> Any:
    """The OpenAI document still marks optional-null fields with OpenAPI 3.0's `nullable: true`, which JSON
    Schema ignores; spell it out as `anyOf: [schema, null]` so that null is accepted exactly there."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _nullable(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


@functools.cache
def _registry(document: str) -> Registry:
    spec = _nullable(json.loads((REFERENCE / document).read_text()))
    return Registry().with_resource(f"urn:{document}", DRAFT202012.create_resource(spec))


@functools.cache
def _validator(document: str, component: str) -> Draft202012Validator:
    schema = {"$ref": f"urn:{document}#/components/schemas/{component}"}
    return Draft202012Validator(schema, registry=_registry(document))


def validate(component: str, instance: Any, document: str = "openai-openapi.json") -> None:
    """Raises with every violation listed when `instance` does not match the component schema."""
    errors = sorted(_validator(document, component).iter_errors(instance), key=lambda e: list(e.path))
    if errors:
        details = "\n".join(f"- at {list(e.path)}: {e.message[:300]}" for e in errors[:10])
        raise AssertionError(f"{component} schema violations:\n{details}")


async def sse_events(url: str, body: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """POSTs a streaming request and returns its (event name, JSON data) pairs; [DONE] as a string."""
    out: list[tuple[str | None, Any]] = []
    async with httpx.AsyncClient(timeout=120) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        name: str | None = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
    return out
