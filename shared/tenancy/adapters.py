"""LoRA adapters added at run time, kept in Redis as keys are: `tokenbus adapters add|remove|list` write the
registry, every edge reads it with the workers' heartbeats, and a job for an adapter carries its path to the
worker that loads it.

An adapter has a base model (the workers that can run it) and, optionally, a tenant: a tenant's adapter is
visible to that tenant's keys alone (any other caller gets the 404 of a model that does not exist). A key whose
--models lists names may use the adapters among them, as it may use models.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from shared.protocol import keys

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""What an adapter may be called: a model name as a URL path and a metrics label take it."""
CONFIG_FILE = "adapter_config.json"
"""What a PEFT adapter's folder holds beside its weights."""


class Adapter(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One adapter a model's workers can load."""

    name: str
    base: str
    """The model whose workers run it."""
    path: str = ""
    """The folder the workers load it from (a volume they share); "" for a worker's own (--lora)."""
    tenant: str = ""
    """The tenant whose keys alone may see it; "": every key that may use its name."""
    created_at: int = 0

    def visible_to(self, tenant: str | None) -> bool:
        """Whether a caller of `tenant` (None: an edge serving without keys) may see it."""
        return tenant is None or not self.tenant or self.tenant == tenant


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Adapter)


def decode(raw: bytes) -> Adapter:
    return _decoder.decode(raw)


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"an adapter's name is 1-128 letters, digits, '.', '_' or '-': {name!r}")
    return name


def parse_modules(spec: str) -> dict[str, str]:
    """A worker's --lora: `NAME=PATH[,NAME=PATH...]` -> {name: path}."""
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, path = part.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora takes NAME=PATH pairs: {part!r}")
        found[check_name(name.strip())] = path.strip()
    return found


def check_folder(path: str) -> str | None:
    """Why the folder is not an adapter here (None when it looks like one)."""
    folder = Path(path)
    if not folder.is_dir():
        return f"{path} is not a folder on this machine"
    if not (folder / CONFIG_FILE).is_file():
        return f"{path} has no {CONFIG_FILE} (a PEFT LoRA adapter's folder has one)"
    return None


async def add(redis: aioredis.Redis, name: str, base: str, path: str, tenant: str = "") -> Adapter:
    """Registers an adapter (or replaces one of that name); edges serve it from their next registry read."""
    if not base:
        raise ValueError("an adapter needs its base model")
    if not path:
        raise ValueError("an adapter needs the path its workers load it from")
    adapter = Adapter(name=check_name(name), base=base, path=path, tenant=tenant, created_at=int(time.time()))
    await redis.hset(keys.ADAPTERS, name, _encoder.encode(adapter))
    return adapter


async def remove(redis: aioredis.Redis, name: str) -> Adapter | None:
    found = await get(redis, name)
    if found is not None:
        await redis.hdel(keys.ADAPTERS, name)
    return found


async def get(redis: aioredis.Redis, name: str) -> Adapter | None:
    raw = await redis.hget(keys.ADAPTERS, name)
    return None if raw is None else decode(raw.encode() if isinstance(raw, str) else raw)


async def list_all(redis: aioredis.Redis) -> list[Adapter]:
    raw: dict[bytes, bytes] = await redis.hgetall(keys.ADAPTERS)  # type: ignore[assignment]
    return sorted(map(decode, raw.values()), key=lambda a: (a.base, a.name))
