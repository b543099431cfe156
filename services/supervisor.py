"""`tokenbus run`: a private Redis (unless one is configured), one worker and one edge, stopped together."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess  # nosec B404: runs our own programs, never a shell
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import redis

from shared.runtime import processes
from shared.runtime.settings import Settings, cache_dir

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
WORKER_READY_TIMEOUT_S = 600.0


REDIS_MAXMEMORY_BYTES = 3 * 1024**3
"""Redis's memory bound: under the 4 GiB the Kubernetes manifest gives its container, leaving room for the
append-only file's rewrite and the allocator's overhead."""
REDIS_ARGS = ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--hz", "1",
              "--maxmemory", str(REDIS_MAXMEMORY_BYTES), "--maxmemory-policy", "noeviction")
"""How tokenbus runs redis-server (here, in docker-compose.yml and in deploy/k8s): an append-only file fsynced
every second, no snapshots, `hz 1`, and a maxmemory past which writes are refused (noeviction), never keys
evicted: evicting would drop queued jobs, keys and limits silently, and without a bound the kernel kills Redis
and its append-only file's replay may kill it again. Refused writes reach clients as 503s; the
TokenbusRedisMemoryHigh alert warns at 80%, and each tenant's storage quota keeps one tenant from filling it.
Besides, `hz 1`: Redis's timer (`hz`, 10 by default) expires keys, checks blocked clients' timeouts and flushes the
AOF; with tokenbus's clients and keys its ticks were most of an idle tokenbus Redis's CPU at the default, and `hz 1`
has a tenth of them (docs/benchmarks.md gives redis-server's CPU while idle, at `hz 1`). At `hz 1` a BLOCK ends up to
a second late (tokenbus's blocking reads block for 2 and 5 s and allow 2 s of grace) and an expired key nobody reads
is dropped later (a read still never sees it). A Redis Cluster keeps the default: its failure detection runs on the
same timer."""


DEPLOY_REDIS = Path(__file__).resolve().parent.parent / "deploy" / "redis"
REDIS_START = DEPLOY_REDIS / "start.sh"
"""What starts Redis in compose and Kubernetes: writes deploy/redis/users.acl with each user's password hash."""


@dataclass(frozen=True)
class TlsFiles:
    """A Redis's certificate and key, and the CA that signed them and its clients' certificates."""

    ca: str
    cert: str
    key: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


MAX_SOCKET_PATH = 100
"""A Unix socket's path is at most 107 bytes on Linux (sun_path); a longer data folder puts it in /tmp."""


def _socket_path(data_dir: str) -> tuple[str, str | None]:
    """Where a Redis with its data in `data_dir` listens; and the folder made for it, if one was."""
    path = os.path.join(os.path.abspath(data_dir), "redis.sock")
    if len(path.encode()) <= MAX_SOCKET_PATH:
        return path, None
    folder = tempfile.mkdtemp(prefix="tokenbus-redis-")
    return os.path.join(folder, "redis.sock"), folder


class RedisServer:
    """A redis-server of our own on a loopback port, run as REDIS_ARGS say, with its append-only file in
    `data_dir`, so that queued jobs and stored responses survive a restart; fault tests kill and restart it.

    With `unix_socket` it also listens on a Unix socket, and its URL names that: every token crosses Redis
    twice (the worker's write, the edge's subscription), and over loopback TCP each message pays the TCP stack
    on both ends: a pipelined XADD + PEXPIRE + SPUBLISH with one subscriber costs the writer, Redis and the
    subscriber each less CPU over the socket than over TCP, the subscriber most of all. A restart keeps the
    socket's path. (A Redis that runs elsewhere, in a container or a cluster, is reached over TCP, as its URL
    says.)"""

    def __init__(self, data_dir: str, port: int | None = None, unix_socket: bool = False,
                 secrets_dir: str | None = None, tls: TlsFiles | None = None, acl: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed: run `make install`, or set TOKENBUS_REDIS_URL")
        self.binary = binary
        self.data_dir = data_dir
        self.port = port or free_port()
        self.socket_path: str | None = None
        self.socket_folder: str | None = None
        if unix_socket:
            self.socket_path, self.socket_folder = _socket_path(data_dir)
        self.secrets_dir = secrets_dir
        self.acl = acl or str(DEPLOY_REDIS / "users.acl")
        self.tls = tls
        scheme = "rediss" if tls else "redis"
        self.url = f"unix://{self.socket_path}?db=0" if self.socket_path else f"{scheme}://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def client_options(self) -> dict[str, Any]:
        """What a redis-py client of this server needs besides its URL (and a user's login)."""
        if self.tls is None:
            return {}
        return {"ssl_ca_certs": self.tls.ca, "ssl_certfile": self.tls.cert, "ssl_keyfile": self.tls.key}

    def start(self) -> str:
        listen = ["--port", str(self.port), "--bind", "127.0.0.1"]
        if self.tls:  # TLS only, clients with a certificate of the CA's, as a deployment's would be
            listen = ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1", "--tls-cert-file",
                      self.tls.cert, "--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca,
                      "--tls-auth-clients", "yes"]
        if self.socket_path:
            os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
            listen += ["--unixsocket", self.socket_path, "--unixsocketperm", "700"]
        command = [self.binary, *listen, *REDIS_ARGS, "--dir", self.data_dir, "--loglevel", "warning"]
        env = None
        if self.secrets_dir is not None:  # the deployments' users, through the script that starts theirs
            command = ["sh", str(REDIS_START), *command]
            env = dict(os.environ, TOKENBUS_REDIS_ACL=self.acl, TOKENBUS_REDIS_SECRETS=self.secrets_dir,
                       TOKENBUS_REDIS_ACL_OUT=os.path.join(self.data_dir, "users.acl"))
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)  # nosec B603: our own argv, no shell
        probe = {"username": "tokenbus-health", "password": "probe"} if self.secrets_dir is not None else {}  # nosec B105: the tests' probe user
        _wait_for_redis(self.url, self.proc, {**self.client_options(), **probe})
        return self.url

    def kill(self) -> None:
        """SIGKILL, as when its machine dies: what the last second wrote may be lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.socket_folder:
            shutil.rmtree(self.socket_folder, ignore_errors=True)


@contextmanager
def private_redis(port: int | None = None, data_dir: str | None = None,
                  unix_socket: bool = False) -> Iterator[str]:
    """A RedisServer on a free loopback port (in a temporary folder unless `data_dir`), and on a Unix socket
    with `unix_socket`; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="tokenbus-redis-") as workdir:
        server = RedisServer(data_dir or workdir, port, unix_socket)
        try:
            yield server.start()
        finally:
            server.stop()


@contextmanager
def private_redis_cluster(masters: int = 3) -> Iterator[str]:
    """A Redis Cluster of `masters` redis-server processes on free loopback ports (no replicas, in a temporary
    folder), for tests and benchmarks; yields the URL of its first node."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise SystemExit("redis-server and redis-cli are needed: run `make install`")
    with tempfile.TemporaryDirectory(prefix="tokenbus-cluster-") as workdir:
        ports: list[int] = []
        while len(ports) < masters:
            if (port := _cluster_port()) not in ports:
                ports.append(port)
        procs = []
        try:
            for port in ports:
                node_dir = os.path.join(workdir, str(port))
                os.makedirs(node_dir)
                procs.append(subprocess.Popen(  # nosec B603: our own argv, no shell
                    [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "yes",
                     "--appendfsync", "everysec", "--dir", node_dir, "--loglevel", "warning"],
                    stdout=subprocess.DEVNULL))
            for port, proc in zip(ports, procs, strict=True):
                _wait_for_redis(f"redis://127.0.0.1:{port}", proc)
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas",  # nosec B603: our own argv, no shell
                            "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
            _wait_for_cluster(f"redis://127.0.0.1:{ports[0]}", masters)
            yield f"redis://127.0.0.1:{ports[0]}"
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _wait_for_cluster(url: str, masters: int, timeout_s: float = 30.0) -> None:
    """Until every node agrees the cluster is up (the slots are assigned and the nodes have met)."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url)
    try:
        while True:
            info = client.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" in text and f"cluster_known_nodes:{masters}" in text:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the Redis Cluster at {url} did not come up: {text}")
            time.sleep(0.1)
    finally:
        client.close()


def _wait_for_redis(url: str, proc: subprocess.Popen[bytes], options: dict[str, Any] | None = None,
                    timeout_s: float = 30.0) -> None:
    """Until Redis answers a PING (with `options` that log in as a user allowed to). A machine busy enough that a
    PING times out is waited for as one still starting; a server that never answers is stopped, not left behind."""
    client = redis.Redis.from_url(url, **(options or {}))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    proc.wait(timeout=10)
                    raise SystemExit(f"redis-server did not start on {url}") from None
                time.sleep(0.05)
    finally:
        client.close()


def child_env(settings: Settings) -> dict[str, str]:
    """The environment that hands these settings to a child process."""
    return processes.settings_env({name: getattr(settings, name) for name in settings.__struct_fields__})


def spawn(role: str, settings: Settings) -> subprocess.Popen[bytes]:
    """A child in this process's group: a terminal's Ctrl-C reaches it too."""
    return processes.spawn(role, child_env(settings), own_session=False)


def wait_until_ready(base_url: str, children: list[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    """True once the edge's /ready answers 200 (every served model has a live worker); False if a child
    died or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children):
            return False
        try:
            with urllib.request.urlopen(base_url + "/ready", timeout=2) as answer:  # nosec B310: our own edge's http:// URL
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def stop_all(children: list[subprocess.Popen[bytes]]) -> None:
    processes.stop(*children, timeout_s=STOP_TIMEOUT_S)


def run(settings: Settings) -> int:
    """Serves until Ctrl-C or SIGTERM, or until a child dies (a worker, past its restarts); returns the exit
    status."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with _redis_for(settings) as url:
        models = [m for m in (settings.model, settings.embedding_model) if m]
        settings = msgspec.structs.replace(_with_redis(settings, url), ready_models=",".join(models))
        children = [_Child("worker", _metrics_on(settings, 1)), _Child("edge", settings)]
        if settings.embedding_model:
            children.append(_Child("worker", msgspec.structs.replace(
                _metrics_on(settings, 2), task="embed", model=settings.embedding_model,
                model_dir=settings.embedding_model_dir, kv_cache_gib=1.0, enable_lora=False, lora="",
            )))  # the adapters are the chat model's
        try:
            host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host  # nosec B104: a comparison; binds nothing
            if wait_until_ready(f"http://{host}:{settings.port}", [c.proc for c in children], WORKER_READY_TIMEOUT_S):
                log.info("ready: http://%s:%d serves %s", settings.host, settings.port, " and ".join(models))
            else:
                stop.set()
            while not stop.is_set() and all(child.kept_running() for child in children):
                stop.wait(0.5)
            failed = [child.proc.args for child in children if child.proc.poll() not in (None, 0)]
        finally:
            log.info("stopping")
            stop_all([child.proc for child in children])
    if failed:
        log.error("a process exited unexpectedly: %s", failed)
        return 1
    return 0


WORKER_RESTARTS = 3
"""Times `tokenbus run` starts a worker again that exited unexpectedly (one whose engine died hands its jobs over
and exits 1, for this to start it again) before it stops everything."""


class _Child:
    """A process `tokenbus run` started, and started again while it may (a worker, WORKER_RESTARTS times)."""

    def __init__(self, role: str, settings: Settings) -> None:
        self.role, self.settings, self.restarts = role, settings, 0
        self.proc = spawn(role, settings)

    def kept_running(self) -> bool:
        """Whether it runs, started again if it is a worker that exited unexpectedly and may be."""
        status = self.proc.poll()
        if status is None:
            return True
        if status == 0 or self.role != "worker" or self.restarts >= WORKER_RESTARTS:
            return False
        self.restarts += 1
        log.warning("the %s worker exited with %d: starting it again (%d of %d)", self.settings.model, status,
                    self.restarts, WORKER_RESTARTS)
        self.proc = spawn(self.role, self.settings)
        return True


@contextmanager
def _redis_for(settings: Settings) -> Iterator[str]:
    if settings.redis_url:
        yield settings.redis_url
    else:
        data_dir = cache_dir() / "redis"  # its append-only file keeps queued jobs and stored responses
        data_dir.mkdir(parents=True, exist_ok=True)
        with private_redis(data_dir=str(data_dir), unix_socket=True) as url:
            log.info("started a private redis-server at %s (data in %s)", url, data_dir)
            yield url


def _metrics_on(settings: Settings, offset: int) -> Settings:
    """A child's metrics port: the edge's is --metrics-port, the worker's the next, the embedder's the one after."""
    port = settings.metrics_port + offset if settings.metrics_port else 0
    return msgspec.structs.replace(settings, metrics_port=port)


def _with_redis(settings: Settings, url: str) -> Settings:
    return msgspec.structs.replace(settings, redis_url=url)
