"""What the edge application holds for its handlers (typed aiohttp app keys)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from aiohttp import web

from services.edge.admission import Admitter
from services.edge.auth import KeyCache
from services.edge.batch_store import BatchStore
from services.edge.call_gate import CallGate
from services.edge.conversation_store import ConversationStore
from services.edge.file_store import FileStore
from services.edge.gateway import Gateway
from services.edge.schema_checks import Checker
from services.edge.store import ResponseStore
from shared.runtime.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
GATEWAY = web.AppKey("gateway", Gateway)
REDIS = web.AppKey("redis", aioredis.Redis)
STORE = web.AppKey("store", ResponseStore)
CONVERSATIONS = web.AppKey("conversations", ConversationStore)
FILES = web.AppKey("files", FileStore)
BATCHES = web.AppKey("batches", BatchStore)
DRAINING = web.AppKey("draining", asyncio.Event)
"""Set on SIGTERM: /ready answers 503 while the edge finishes its streams."""
KEYS = web.AppKey("keys", KeyCache)
ADMITTER = web.AppKey("admitter", Admitter)
CALL_GATE = web.AppKey("call_gate", CallGate)
"""Each tenant's calls in flight here to the routes that run no model (services.edge.call_gate)."""
CHECKER = web.AppKey("checker", Checker)
"""The edge's process for the schema and pattern checks that cost by the byte (services.edge.schema_checks)."""
RATE_HEADERS = web.RequestKey("rate_headers", dict[str, str])
"""The caller's x-ratelimit-* headers, set before its answer starts."""
REQUEST_ID = web.RequestKey("request_id", str)
"""The client's x-request-id (when it is a sane one) or one of ours: returned, logged, carried by the job."""
