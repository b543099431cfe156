"""Real processes for fault tests: a redis-server of their own (with its append-only file), edges and
simulated workers (`tokenbus worker --engine sim`), each a separate process to kill or stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from services.supervisor import DEPLOY_REDIS, RedisServer, TlsFiles
from shared.protocol import keys
from tests.processes import Edge, WorkerProcess, metric_value, start_edge, started_worker, stop_process

FAST_BEATS = {"heartbeat_ttl_s": 2, "heartbeat_interval_s": 0.5}
"""Faults are noticed within two seconds: a test need not wait the production TTL."""

AS_DEPLOYED = os.environ.get("TOKENBUS_TEST_REDIS_USERS") == "1"
"""Every Stack runs Redis with the deployments' users and its edges and workers log in as theirs (the stack's own
client as a user allowed everything): `TOKENBUS_TEST_REDIS_USERS=1 pytest tests/test_faults.py` runs a module's
paths against deploy/redis/users.acl."""
DEPLOYED_USERS = {"edge": "tokenbus-edge", "worker": "tokenbus-worker"}


@dataclass
class Stack:
    root: Path
    model: str = "fault-model"
    unix_socket: bool = False
    """Redis reached over a Unix socket, as `tokenbus run` reaches its private one, rather than loopback TCP."""
    secrets: Path | None = None
    """A folder of password files named after deploy/redis/users.acl's users: Redis runs with those users, as
    deployed (the processes are started with a user's settings; this stack's own client logs in as `login`)."""
    tls: TlsFiles | None = None
    """Redis speaks TLS only, and asks clients for a certificate (processes get redis_tls_* settings)."""
    login: dict[str, str] = field(default_factory=dict)
    """The username and password of this stack's own client (by default Redis's default user)."""
    redis: RedisServer = field(init=False)
    edges: list[Edge] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.root / "redis").mkdir(parents=True, exist_ok=True)
        acl = None
        if AS_DEPLOYED and self.secrets is None:
            acl, self.secrets, self.login = self._deployed_users()
        self.redis = RedisServer(str(self.root / "redis"), unix_socket=self.unix_socket,
                                 secrets_dir=str(self.secrets) if self.secrets else None, tls=self.tls, acl=acl)
        self.url = self.redis.start()
        self.client = redis.Redis.from_url(self.url, **self.redis.client_options(), **self.login)

    def _deployed_users(self) -> tuple[str, Path, dict[str, str]]:
        """users.acl and a user of the test's own allowed everything; a password file for each."""
        secrets = self.root / "redis-users"
        secrets.mkdir()
        for user in [*DEPLOYED_USERS.values(), "tokenbus-admin", "tokenbus-test"]:
            (secrets / user).write_text(f"{user}-password")
        acl = self.root / "users.acl"
        acl.write_text((DEPLOY_REDIS / "users.acl").read_text() + "user tokenbus-test on +@all ~* &*\n")
        return str(acl), secrets, {"username": "tokenbus-test", "password": "tokenbus-test-password"}

    def _logged_in(self, role: str, settings: dict[str, Any]) -> dict[str, Any]:
        if not AS_DEPLOYED or self.secrets is None or "redis_username" in settings:
            return settings
        user = DEPLOYED_USERS[role]
        return {"redis_username": user, "redis_password_file": str(self.secrets / user), **settings}

    def admin_env(self) -> dict[str, str]:
        """The environment `tokenbus keys` and `tokenbus usage` run with against this stack's Redis."""
        env = {"TOKENBUS_REDIS_URL": self.url, "PATH": "/usr/bin:/bin"}
        if self.secrets is not None:
            env |= {"TOKENBUS_REDIS_USERNAME": "tokenbus-admin",
                    "TOKENBUS_REDIS_PASSWORD_FILE": str(self.secrets / "tokenbus-admin")}
        return env

    def edge(self, **settings: Any) -> Edge:
        settings = self._logged_in("edge", settings)
        edge = start_edge(self.url, self.root, f"edge{len(self.edges)}", model=self.model,
                          **{**FAST_BEATS, **settings})
        self.edges.append(edge)
        return edge

    def worker(self, **settings: Any) -> WorkerProcess:
        """A simulated worker, returned once its own heartbeat shows."""
        settings = self._logged_in("worker", settings)
        worker = started_worker(self.url, self.client, self.root / f"worker{len(self.workers)}.log", self.model,
                                timeout_s=60, engine="sim", **{**FAST_BEATS, **settings})
        self.workers.append(worker)
        return worker

    def heartbeat_of(self, pid: int) -> bool:
        return any(f"-{pid}-" in key.decode() for key in self.client.scan_iter(keys.worker_heartbeat(self.model, "*")))

    def busiest(self) -> WorkerProcess:
        """The live worker with the most jobs pending in the queue's consumer group (on every request stream)."""
        counts: dict[str, int] = {}
        for summary in self._pending_summaries():
            for consumer in summary["consumers"]:
                name = consumer["name"].decode()
                counts[name] = counts.get(name, 0) + int(consumer["pending"])
        live = [w for w in self.workers if w.process.poll() is None]
        return max(live, key=lambda w: sum(n for name, n in counts.items() if f"-{w.process.pid}-" in name))

    def request_streams(self) -> list[str]:
        """The model's request stream and the workers' own streams (cache-aware dispatch)."""
        own = self.client.scan_iter(keys.worker_requests(self.model, "*"), _type="stream")
        return [keys.requests_stream(self.model), *(key.decode() for key in own)]

    def _pending_summaries(self) -> list[Any]:
        summaries = []
        for stream in self.request_streams():
            with contextlib.suppress(redis.ResponseError):  # a stream without the group yet
                summaries.append(self.client.xpending(stream, keys.WORKER_GROUP))
        return summaries

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL of the process and its children, as when its container dies."""
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def consumers(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.client.xinfo_consumers(keys.requests_stream(self.model), keys.WORKER_GROUP)
        return found

    def on_streams(self) -> int:
        """Entries on every request stream of the model, read or not."""
        return sum(self.client.xlen(stream) for stream in self.request_streams())

    def pending(self) -> int:
        """Entries read by a worker and not yet acknowledged, on every request stream of the model."""
        return sum(int(summary["pending"]) for summary in self._pending_summaries())

    async def settled(self, timeout_s: float = 15.0) -> None:
        """Waits until nothing is pending, no edge has a request in flight and no live worker runs a job."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self._unsettled()
            if not state:
                return
            assert time.monotonic() < deadline, f"not settled: {state}"
            await asyncio.sleep(0.2)

    async def _unsettled(self) -> dict[str, float]:
        state: dict[str, float] = {"pending": self.pending()}
        async with httpx.AsyncClient() as http:
            for edge in (e for e in self.edges if e.process.poll() is None):
                text = (await http.get(edge.metrics_url)).text
                state[edge.url] = metric_value(text, "tokenbus_edge_requests_in_flight")
            for worker in (w for w in self.workers if w.process.poll() is None):
                text = (await http.get(worker.metrics_url)).text
                state[worker.metrics_url] = metric_value(text, "tokenbus_worker_running_jobs")
        return {name: value for name, value in state.items() if value}

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for process in [e.process for e in self.edges] + [w.process for w in self.workers]:
            stop_process(process)
        self.client.close()
        self.redis.stop()
