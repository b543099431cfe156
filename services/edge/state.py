"""What the edge application holds for its handlers (typed aiohttp app keys)."""

from __future__ import annotations

import redis.asyncio as aioredis
from aiohttp import web

from services.edge.gateway import Gateway
from services.edge.store import ResponseStore
from shared.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
GATEWAY = web.AppKey("gateway", Gateway)
REDIS = web.AppKey("redis", aioredis.Redis)
STORE = web.AppKey("store", ResponseStore)
