"""Every route of the edge in one table: the router, the OpenAPI document, authentication, rate limits and
the error shape all read it.

A route's family decides the rest: `openai` routes (OpenAI, Databricks, OVMS) answer errors in OpenAI's
shape, `tgi` routes in TGI's, `anthropic` routes in Anthropic's, and all need an API key and Redis; `ops`
routes (health, readiness, the API document) need neither, so they answer during a Redis outage and to anyone.
The metrics are served on a port of their own (--metrics-port), not here.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.edge import background, batches, conversations, files, handlers, openapi, ops
from services.edge.file_store import FileInfo
from services.edge.formats import batches as batch_shapes
from services.edge.formats import (
    chat,
    completions,
    conversation_items,
    embeddings,
    messages,
    messages_render,
    rerank,
    response_render,
    responses,
    tgi,
    tokenize,
)
from services.edge.formats import files as files_shapes
from services.edge.formats.models import ModelCard, ModelList

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    family: str
    """openai | tgi | anthropic | ops"""
    summary: str = ""
    request: Any = None
    """The body's msgspec struct, or a tuple of them (one of), for the OpenAPI document."""
    response: Any = None
    streams: bool = False
    runs_model: bool = False
    """It spends the key's limits (generation, embeddings); other key routes only report them."""

    @property
    def template(self) -> str:
        """The path as aiohttp names its resource, and OpenAPI its path: a variable's pattern left out
        (`{model:.+}` is `{model}`)."""
        return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", self.path)

    @property
    def needs_key(self) -> bool:
        return self.family != "ops"

    @property
    def needs_redis(self) -> bool:
        return self.family != "ops"


def _openai(method: str, path: str, handler: Handler, summary: str, request: Any = None, response: Any = None,
            streams: bool = False, runs_model: bool = False) -> list[Route]:
    route = Route(method, path, handler, "openai", summary, request, response, streams, runs_model)
    if not path.startswith("/v1/"):
        return [route]
    alias = handlers.OVMS_PREFIX + path.removeprefix("/v1")
    return [route, Route(method, alias, handler, "openai", summary, request, response, streams, runs_model)]


def api_document() -> bytes:
    """The OpenAPI document of every route a client calls (not the operational ones)."""
    return openapi.document(tuple(r for r in ROUTES if r.family != "ops"))


async def openapi_document(request: web.Request) -> web.Response:
    return web.Response(body=api_document(), content_type="application/json")


ROUTES: list[Route] = [
    *_openai("post", "/v1/chat/completions", handlers.chat_completions, "OpenAI Chat Completions",
             chat.ChatCompletionRequest, chat.ChatCompletion, streams=True, runs_model=True),
    *_openai("post", "/v1/completions", handlers.text_completions, "OpenAI Completions",
             completions.CompletionRequest, completions.Completion, streams=True, runs_model=True),
    *_openai("post", "/v1/responses", handlers.create_response, "OpenAI Responses", responses.ResponsesRequest,
             response_render.Response, streams=True, runs_model=True),
    *_openai("post", "/v1/responses/input_tokens", handlers.count_input_tokens,
             "Count a response's input tokens (instructions, the conversation it continues, tools), running nothing",
             responses.InputTokensRequest, response_render.InputTokens, runs_model=True),
    *_openai("get", "/v1/responses/{response_id}", handlers.get_response, "A stored response",
             response=response_render.Response),
    *_openai("get", "/v1/responses/{response_id}/input_items", handlers.list_input_items,
             "A stored response's input items (`limit`, `order`, `after`)", response=conversation_items.ItemList),
    *_openai("delete", "/v1/responses/{response_id}", handlers.delete_response, "Delete a stored response",
             response=response_render.Deleted),
    *_openai("post", "/v1/responses/{response_id}/cancel", background.cancel, "Cancel a background response",
             response=response_render.Response),
    *_openai("post", "/v1/conversations", conversations.create, "Create a conversation",
             conversation_items.CreateConversationBody, conversation_items.ConversationResource),
    *_openai("get", "/v1/conversations/{conversation_id}", conversations.retrieve, "A conversation",
             response=conversation_items.ConversationResource),
    *_openai("post", "/v1/conversations/{conversation_id}", conversations.update, "Update a conversation's metadata",
             conversation_items.UpdateConversationBody, conversation_items.ConversationResource),
    *_openai("delete", "/v1/conversations/{conversation_id}", conversations.delete, "Delete a conversation",
             response=conversation_items.DeletedConversation),
    *_openai("get", "/v1/conversations/{conversation_id}/items", conversations.list_items,
             "A conversation's items (`limit`, `order`, `after`)", response=conversation_items.ItemList),
    *_openai("post", "/v1/conversations/{conversation_id}/items", conversations.add_items,
             "Add items to a conversation", conversation_items.AddItemsBody, conversation_items.ItemList),
    *_openai("get", "/v1/conversations/{conversation_id}/items/{item_id}", conversations.retrieve_item,
             "A conversation's item"),
    *_openai("delete", "/v1/conversations/{conversation_id}/items/{item_id}", conversations.delete_item,
             "Delete a conversation's item", response=conversation_items.ConversationResource),
    *_openai("post", "/v1/files", files.create, "Upload a file (multipart: `file`, `purpose` batch or user_data)",
             response=FileInfo),
    *_openai("get", "/v1/files", files.list_files, "The caller's files (`purpose`, `limit`, `order`, `after`)",
             response=files_shapes.FileList),
    *_openai("get", "/v1/files/{file_id}", files.retrieve, "A file's description", response=FileInfo),
    *_openai("delete", "/v1/files/{file_id}", files.delete, "Delete a file", response=files_shapes.DeletedFile),
    *_openai("get", "/v1/files/{file_id}/content", files.content, "A file's bytes"),
    *_openai("post", "/v1/batches", batches.create, "Create a batch over a batch input file",
             batch_shapes.CreateBatch, batch_shapes.Batch),
    *_openai("get", "/v1/batches", batches.list_batches, "The caller's batches, newest first (`limit`, `after`)",
             response=batch_shapes.BatchList),
    *_openai("get", "/v1/batches/{batch_id}", batches.retrieve, "A batch", response=batch_shapes.Batch),
    *_openai("post", "/v1/batches/{batch_id}/cancel", batches.cancel, "Cancel a batch", response=batch_shapes.Batch),
    *_openai("post", "/v1/embeddings", handlers.create_embeddings, "OpenAI Embeddings", embeddings.EmbeddingRequest,
             embeddings.EmbeddingList, runs_model=True),
    *_openai("post", "/v1/rerank", handlers.rerank, "Rerank documents by a query (Jina, vLLM; OVMS on /v3)",
             rerank.RerankRequest, rerank.RerankResponse, runs_model=True),
    *_openai("post", "/v2/rerank", handlers.rerank, "Rerank documents by a query (Cohere)", rerank.RerankRequest,
             rerank.RerankResponse, runs_model=True),
    *_openai("post", "/v1/score", handlers.score, "Score text pairs (vLLM)", rerank.ScoreRequest,
             rerank.ScoreResponse, runs_model=True),
    *_openai("get", "/v1/models", handlers.list_models, "The models and LoRA adapters the key may use",
             response=ModelList),
    *_openai("get", "/v1/models/{model:.+}", handlers.retrieve_model, "A model or LoRA adapter the key may use",
             response=ModelCard),
    *_openai("get", "/v1/streams/{stream_id}", handlers.resume_stream,
             "Resume a stream after Last-Event-ID (header or `last_event_id` query)"),
    *_openai("post", "/serving-endpoints/{name}/invocations", handlers.invocations,
             "Databricks serving endpoint: `messages` is chat, `prompt` completions, `input` embeddings or responses",
             (chat.ChatCompletionRequest, completions.CompletionRequest, embeddings.EmbeddingRequest),
             (chat.ChatCompletion, completions.Completion, embeddings.EmbeddingList), streams=True, runs_model=True),
    Route("post", "/generate", handlers.generate, "tgi", "TGI / MindIE text generation", tgi.GenerateRequest,
          tgi.GenerateResponse, runs_model=True),
    Route("post", "/generate_stream", handlers.generate_stream, "tgi", "TGI / MindIE streamed text generation",
          tgi.GenerateRequest, tgi.StreamResponse, streams=True, runs_model=True),
    Route("post", "/", handlers.compat_generate, "tgi", "TGI / MindIE: the body's `stream` decides",
          tgi.GenerateRequest, list[tgi.GenerateResponse], streams=True, runs_model=True),
    Route("post", "/v1/messages", handlers.create_message, "anthropic", "Anthropic Messages",
          messages.MessagesRequest, messages_render.Message, streams=True, runs_model=True),
    Route("post", "/v1/messages/count_tokens", handlers.count_message_tokens, "anthropic",
          "Anthropic: the tokens of a Messages request's prompt", messages.CountTokensRequest,
          messages_render.CountTokens, runs_model=True),
    Route("get", "/info", handlers.tgi_info, "tgi", "TGI model information", response=tgi.Info),
    *_openai("post", "/tokenize", handlers.tokenize,
             "Tokenize: vLLM's (a `prompt`, or `messages` through the chat template) or TGI's (`inputs`, each "
             "token with its span)", (tokenize.TokenizePromptRequest, tokenize.TokenizeChatRequest,
                                      tgi.GenerateRequest),
             (tokenize.TokenizeResponse, list[tokenize.SimpleToken]), runs_model=True),
    *_openai("post", "/detokenize", handlers.detokenize, "vLLM's detokenize: the text of token ids",
             tokenize.DetokenizeRequest, tokenize.DetokenizeResponse, runs_model=True),
    Route("get", "/health", ops.health, "ops"),
    Route("get", "/ready", ops.ready, "ops"),
    Route("get", "/openapi.json", openapi_document, "ops"),
]

UNMATCHED = Route("", "unmatched", ops.health, "ops")
"""What a request no route matched is treated as: refused with a 404 or 405 in OpenAI's shape."""
BY_METHOD_AND_PATH = {(r.method.upper(), r.template): r for r in ROUTES}
BY_PATH = {r.template: r for r in ROUTES}
"""A path's routes share a family: a method a path does not serve is refused in that family's shape."""


def route_of(request: web.Request) -> Route:
    resource = request.match_info.route.resource
    if resource is None:  # no route, or (a 405) none of this method: a fixed path still names its family
        return BY_PATH.get(request.path, UNMATCHED)
    path = resource.canonical
    return BY_METHOD_AND_PATH.get((request.method, path)) or BY_PATH.get(path, UNMATCHED)


def add_to(app: web.Application) -> None:
    for route in ROUTES:
        app.router.add_route(route.method.upper(), route.path, route.handler)
