"""GET /openapi.json: the public API, described from the same msgspec structs that validate it."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from services.edge.formats import base, messages_render

ERRORS = {"anthropic": messages_render.ErrorBody}
"""The error body of a route family whose errors are not in OpenAI's shape."""


def _schema(kind: Any, refs: dict[Any, Any]) -> dict[str, Any]:
    return {"oneOf": [refs[k] for k in kind]} if isinstance(kind, tuple) else refs[kind]


def _operation(summary: str, request: Any, response: Any, streams: bool, refs: dict[Any, Any],
               error: Any = base.ErrorBody) -> dict[str, Any]:
    schema = {"type": "object"} if response is None else _schema(response, refs)
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string", "description": "server-sent events"}}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": content},
                      "400": {"description": "Invalid request",
                              "content": {"application/json": {"schema": refs[error]}}}},
    }
    if request is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": _schema(request, refs)}}}
    return operation


@functools.cache
def document(routes: tuple[Any, ...]) -> bytes:
    """The document of the given routes (services.edge.routes.Route)."""
    named = [k for r in routes for k in (r.request, r.response) if k is not None]
    kinds = list(dict.fromkeys(k for kind in named for k in (kind if isinstance(kind, tuple) else (kind,))))
    kinds += [base.ErrorBody, *{ERRORS[r.family] for r in routes if r.family in ERRORS}]
    schemas, components = msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")
    refs = dict(zip(kinds, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        paths.setdefault(r.template, {})[r.method] = _operation(r.summary, r.request, r.response, r.streams, refs,
                                                            ERRORS.get(r.family, base.ErrorBody))
    return msgspec.json.encode({
        "openapi": "3.1.0",
        "info": {"title": "tokenbus", "version": "0.1.0",
                 "description": "OpenAI, Anthropic, TGI/MindIE, Databricks and OVMS APIs over one event bus. A "
                                "request's `model` (TGI: `parameters.adapter_id`) may name a LoRA adapter the key "
                                "may use (GET /v1/models lists them with their `parent`); rerank and score run on "
                                "a cross-encoder or, by cosine similarity, on an embedding model."},
        "paths": paths,
        "components": {"schemas": components},
    })

