"""GET /openapi.json: the public API, described from the same msgspec structs that validate it."""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from aiohttp import web

from services.edge.formats import base, chat, completions, embeddings, responses, tgi

# (method, path, summary, request struct(s), response struct(s), streams); a tuple is "one of these"
ROUTES: list[tuple[str, str, str, Any, Any, bool]] = [
    ("post", "/v1/chat/completions", "OpenAI Chat Completions", chat.ChatCompletionRequest,
     chat.ChatCompletion, True),
    ("post", "/v1/completions", "OpenAI Completions", completions.CompletionRequest, completions.Completion, True),
    ("post", "/v1/responses", "OpenAI Responses", responses.ResponsesRequest, responses.Response, True),
    ("get", "/v1/responses/{response_id}", "A stored response", None, responses.Response, False),
    ("delete", "/v1/responses/{response_id}", "Delete a stored response", None, responses.Deleted, False),
    ("post", "/v1/embeddings", "OpenAI Embeddings", embeddings.EmbeddingRequest, embeddings.EmbeddingList, False),
    ("post", "/serving-endpoints/{name}/invocations",
     "Databricks serving endpoint: `messages` is chat, `prompt` completions, `input` embeddings or responses",
     (chat.ChatCompletionRequest, completions.CompletionRequest, embeddings.EmbeddingRequest),
     (chat.ChatCompletion, completions.Completion, embeddings.EmbeddingList), True),
    ("post", "/generate", "TGI / MindIE text generation", tgi.GenerateRequest, tgi.GenerateResponse, False),
    ("post", "/generate_stream", "TGI / MindIE streamed text generation", tgi.GenerateRequest, tgi.StreamResponse,
     True),
    ("post", "/", "TGI / MindIE: the body's `stream` decides", tgi.GenerateRequest, list[tgi.GenerateResponse],
     True),
    ("get", "/info", "TGI model information", None, tgi.Info, False),
]
ALIASES = {"/v3" + path[3:]: path for _m, path, *_ in ROUTES if path.startswith("/v1/")}
"""OpenVINO Model Server's /v3 paths serve the same operations."""


def _schema(kind: Any, refs: dict[Any, Any]) -> dict[str, Any]:
    return {"oneOf": [refs[k] for k in kind]} if isinstance(kind, tuple) else refs[kind]


def _operation(summary: str, request: Any, response: Any, streams: bool, refs: dict[Any, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _schema(response, refs)}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string", "description": "server-sent events"}}
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": content},
                      "400": {"description": "Invalid request",
                              "content": {"application/json": {"schema": refs[base.ErrorBody]}}}},
    }
    if request is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": _schema(request, refs)}}}
    return operation


@functools.cache
def document() -> bytes:
    named = [k for _m, _p, _s, req, resp, _st in ROUTES for k in (req, resp) if k is not None]
    kinds = list(dict.fromkeys(k for kind in named for k in (kind if isinstance(kind, tuple) else (kind,))))
    kinds.append(base.ErrorBody)
    schemas, components = msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")
    refs = dict(zip(kinds, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, request, response, streams in ROUTES:
        paths.setdefault(path, {})[method] = _operation(summary, request, response, streams, refs)
    for alias, path in ALIASES.items():
        paths[alias] = paths[path]
    return msgspec.json.encode({
        "openapi": "3.1.0",
        "info": {"title": "tokenbus", "version": "0.1.0",
                 "description": "OpenAI, TGI/MindIE, Databricks and OVMS APIs over one event bus."},
        "paths": paths,
        "components": {"schemas": components},
    })


async def serve(request: web.Request) -> web.Response:
    return web.Response(body=document(), content_type="application/json")
