"""`tokenbus keys` (create, list, show, update, revoke API keys), `tokenbus adapters` (add, remove, list LoRA
adapters) and `tokenbus usage` (tokens per tenant and model): the operator's commands. Each talks to the Redis
every edge uses (--redis-url or TOKENBUS_REDIS_URL)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared.protocol import keys
from shared.redisio import clients as redis_clients
from shared.runtime.settings import ENV_PREFIX
from shared.tenancy import adapters, apikeys
from shared.tenancy.apikeys import KeyChanges, KeyRecord

_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_USAGE_FIELDS = ("requests", "prompt", "completion", "batch_requests", "batch_prompt", "batch_completion")
"""Per tenant and model: interactive requests and tokens, and those of batch lines (counted apart)."""
_TOKEN_FIELDS = ("prompt", "completion", "batch_prompt", "batch_completion")
_USAGE_KEY = re.compile(r"^tokenbus:usage:\{(?P<key>[^}]*)\}:(?P<day>\d{4}-\d{2}-\d{2})$")


def expiry(value: str) -> int:
    """`--expires`: a duration from now (90d, 12h) or a date/time (2027-01-31, 2027-01-31T12:00:00Z)."""
    if match := _DURATION.match(value):
        return int(time.time()) + int(match[1]) * _SECONDS[match[2]]
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration (90d) or a date (2027-01-31): {value}") from None
    return int((moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp())


def _models(value: str) -> list[str]:
    return [m for m in (part.strip() for part in value.split(",")) if m]


def _limit_arguments(parser: argparse.ArgumentParser, creating: bool) -> None:
    parser.add_argument("--tenant", required=creating, help="who the key belongs to")
    parser.add_argument("--models", type=_models, help="comma-separated models the key may use (default: all)")
    for name, text in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute (prompt + completion)"),
                       ("--max-concurrency", "requests in flight at once"),
                       ("--quota-tokens", "tokens per quota period")):
        parser.add_argument(name, type=int, help=f"{text}; 0: no limit")
    for name, text in (("--storage-bytes", "bytes its tenant may hold stored (responses, resumable streams)"),
                       ("--storage-items", "stored responses its tenant may hold")):
        parser.add_argument(name, type=int, help=f"{text}; 0: no limit (default: the deployment's {name})")
    parser.add_argument("--quota-period", choices=apikeys.QUOTA_PERIODS)
    parser.add_argument("--weight", type=float, help="share of a model's workers against other keys (default 1)")
    parser.add_argument("--priority", type=int, help=f"strict priority band 0-{apikeys.MAX_PRIORITY} (default 0)")
    parser.add_argument("--expires", type=expiry, dest="expires_at",
                        help="when the key stops working: 90d, 12h, or a date (default: never)")


ACCESS_FLAGS = {"redis_username": "Redis ACL user (the deployments' is tokenbus-admin)",
                "redis_password_file": "file holding its password",  # nosec B105: a flag's help text
                "redis_tls_ca_file": "CA of Redis's certificate, for a rediss:// URL",
                "redis_tls_cert_file": "client certificate, if Redis asks for one",
                "redis_tls_key_file": "its private key"}


def _redis_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=None, help=f"default: ${ENV_PREFIX}REDIS_URL")
    parser.add_argument("--redis-cluster", action="store_true",
                        help=f"the Redis is a node of a Redis Cluster (default: ${ENV_PREFIX}REDIS_CLUSTER)")
    for name, text in ACCESS_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), default=None,
                            help=f"{text} (default: ${ENV_PREFIX}{name.upper()})")


def _access(args: argparse.Namespace) -> redis_clients.Access:
    """The login its flags (or else the TOKENBUS_REDIS_* variables the edges use) give the command."""
    return redis_clients.Access(**{name.removeprefix("redis_"): getattr(args, name, None)
                                   or os.environ.get(ENV_PREFIX + name.upper(), "") for name in ACCESS_FLAGS})


def add_arguments(commands: Any) -> None:
    key_parser = commands.add_parser("keys", help="manage API keys", description="Manage API keys.")
    _redis_arguments(key_parser)
    key_parser.add_argument("--json", action="store_true", help="print JSON")
    actions = key_parser.add_subparsers(dest="keys_command", required=True)
    _limit_arguments(actions.add_parser("create", help="make a key; it is printed once"), creating=True)
    actions.add_parser("list", help="every key (ids, never the keys)")
    for name, text in (("show", "one key's settings"), ("revoke", "delete a key (every edge refuses it at once)")):
        actions.add_parser(name, help=text).add_argument("id", help="the key's id, as `keys list` shows it")
    update = actions.add_parser("update", help="change a key's settings")
    update.add_argument("id")
    _limit_arguments(update, creating=False)

    adapter_parser = commands.add_parser(
        "adapters", help="manage LoRA adapters", description="Manage the LoRA adapters the workers load at run time.")
    _redis_arguments(adapter_parser)
    adapter_parser.add_argument("--json", action="store_true", help="print JSON")
    adapter_actions = adapter_parser.add_subparsers(dest="adapters_command", required=True)
    add = adapter_actions.add_parser("add", help="serve an adapter (or replace the one of that name)")
    add.add_argument("name", help="what requests call it (`model`)")
    add.add_argument("--base", required=True, help="the model whose workers run it (they need --enable-lora)")
    add.add_argument("--path", required=True, help="its PEFT folder, as the workers see it (a shared volume)")
    add.add_argument("--tenant", default="", help="the tenant whose keys alone may use it (default: any key)")
    adapter_actions.add_parser("list", help="every adapter added")
    adapter_actions.add_parser("remove", help="stop serving an adapter").add_argument("name")

    usage = commands.add_parser("usage", help="tokens used per tenant and model",
                                description="Tokens used per tenant and model, from the daily counts in Redis.")
    _redis_arguments(usage)
    usage.add_argument("--tenant", help="only this tenant")
    usage.add_argument("--since", default=None, help="first day counted, YYYY-MM-DD (default: 30 days ago)")
    usage.add_argument("--json", action="store_true", help="print JSON")


def _changes(args: argparse.Namespace) -> KeyChanges:
    fields = {f: getattr(args, f) for f in KeyChanges.__struct_fields__ if getattr(args, f, None) is not None}
    return KeyChanges(**fields)


def _show(record: KeyRecord) -> dict[str, Any]:
    shown = msgspec.to_builtins(record)
    shown.pop("hash", None)
    return dict(shown)


def _print(value: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(value))
    elif isinstance(value, list):
        for item in value:
            _print(item, False)
    else:
        print("  ".join(f"{k}={v}" for k, v in value.items()))


async def _keys(redis: aioredis.Redis, args: argparse.Namespace) -> int:
    command = args.keys_command
    if command == "create":
        key, record = await apikeys.create(redis, _changes(args))
        if args.json:
            print(json.dumps({"key": key, **_show(record)}))
        else:
            print(key)
            print(f"key {record.id} of tenant {record.tenant}: store it now, it is not shown again", file=sys.stderr)
        return 0
    if command == "list":
        _print([_show(r) for r in await apikeys.list_all(redis)], args.json)
        return 0
    if command == "show":
        found = await apikeys.get(redis, args.id)
    elif command == "update":
        found = await apikeys.update(redis, args.id, _changes(args))
    else:
        found = await apikeys.revoke(redis, args.id)
    if found is None:
        print(f"no key with id {args.id}", file=sys.stderr)
        return 1
    _print({"revoked": True, **_show(found)} if command == "revoke" else _show(found), args.json)
    return 0


async def _adapters(redis: aioredis.Redis, args: argparse.Namespace) -> int:
    command = args.adapters_command
    if command == "add":
        if problem := adapters.check_folder(args.path):  # the workers may see another filesystem: a warning
            print(f"warning: {problem}; the workers of {args.base} must find it there", file=sys.stderr)
        _print(msgspec.to_builtins(await adapters.add(redis, args.name, args.base, args.path, args.tenant)), args.json)
        return 0
    if command == "list":
        _print([msgspec.to_builtins(a) for a in await adapters.list_all(redis)], args.json)
        return 0
    found = await adapters.remove(redis, args.name)
    if found is None:
        print(f"no adapter named {args.name}", file=sys.stderr)
        return 1
    _print({"removed": True, **msgspec.to_builtins(found)}, args.json)
    return 0


async def usage_rows(redis: aioredis.Redis, tenant: str | None, since: str) -> list[dict[str, Any]]:
    """Requests and tokens per tenant and model, summed over the days from `since` (YYYY-MM-DD) on."""
    totals: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(_USAGE_FIELDS, 0))
    async for name in redis.scan_iter(match=f"{keys.PREFIX}:usage:*", count=1000):
        match = _USAGE_KEY.match(name.decode() if isinstance(name, bytes) else name)
        if match is None or match["day"] < since:
            continue
        raw: dict[bytes, bytes] = await redis.hgetall(name)  # type: ignore[assignment]
        counts = {k.decode(): v.decode() for k, v in raw.items()}
        owner = counts.pop("tenant", "")
        if tenant is not None and owner != tenant:
            continue
        for field, value in counts.items():
            model, _, what = field.rpartition("|")
            totals[(owner, model)][what] += int(value)
    return [{"tenant": t, "model": m, **counts, "total_tokens": sum(counts[f] for f in _TOKEN_FIELDS)}
            for (t, m), counts in sorted(totals.items())]


async def _usage(redis: aioredis.Redis, args: argparse.Namespace) -> int:
    since = args.since or datetime.fromtimestamp(time.time() - 30 * 86400, UTC).strftime("%Y-%m-%d")
    _print(await usage_rows(redis, args.tenant, since), args.json)
    return 0


async def _main(args: argparse.Namespace) -> int:
    url = args.redis_url or os.environ.get(ENV_PREFIX + "REDIS_URL")
    if not url:
        print(f"say which Redis: --redis-url or ${ENV_PREFIX}REDIS_URL", file=sys.stderr)
        return 2
    cluster = getattr(args, "redis_cluster", False) or os.environ.get(ENV_PREFIX + "REDIS_CLUSTER", "").lower() in (
        "1", "true", "yes")
    redis = redis_clients.pooled(url, "tokenbus-admin", 4, cluster, _access(args))
    try:
        command = {"keys": _keys, "adapters": _adapters, "usage": _usage}[args.command]
        return await command(redis, args)
    except ValueError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    finally:
        with contextlib.suppress(RuntimeError):  # redis-py's cluster client, after a transaction (see worker.stop)
            await redis.aclose()


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))
