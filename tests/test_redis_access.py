"""Redis with least privilege, against real processes: a redis-server started by deploy/redis/start.sh with
deploy/redis/users.acl (what compose and Kubernetes run), passwords of the test's own; an edge, a simulated worker
and `tokenbus keys` each logged in as its own user, over TCP and over TLS (`rediss://`, a throwaway CA)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from services.supervisor import TlsFiles
from shared.protocol import keys
from shared.redisio import clients as redis_clients
from tests.processes import ROOT
from tests.stack import Stack

USERS = ("tokenbus-edge", "tokenbus-worker", "tokenbus-admin")


@pytest.fixture
def passwords(tmp_path: Path) -> Path:
    """One password file per user of users.acl, as a compose secret or a Kubernetes Secret mounts them (the
    edge's ends with a line end, as `echo` writes it)."""
    folder = tmp_path / "secrets"
    folder.mkdir()
    for user in USERS:
        (folder / user).write_text(secrets.token_hex(16) + ("\n" if user == "tokenbus-edge" else ""))
    return folder


def login(passwords: Path, user: str) -> dict[str, str]:
    return {"redis_username": user, "redis_password_file": str(passwords / user)}


def password(passwords: Path, user: str) -> str:
    return redis_clients.read_password(str(passwords / user))


def client_of(stack: Stack, passwords: Path, user: str) -> redis.Redis:
    return redis.Redis.from_url(stack.url, username=user, password=password(passwords, user),
                                **stack.redis.client_options())


def worker_login(passwords: Path) -> dict[str, str]:
    return {"username": "tokenbus-worker", "password": password(passwords, "tokenbus-worker")}


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


@pytest.fixture
def tls(tmp_path: Path) -> TlsFiles:
    """A throwaway CA and one certificate it signed for 127.0.0.1 (Redis's, and the clients' too)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("tokenbus test CA")).issuer_name(_name("tokenbus test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder = tmp_path / "tls"
    folder.mkdir()
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "redis.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(folder / "redis.key", key)
    return TlsFiles(ca=str(folder / "ca.pem"), cert=str(folder / "redis.pem"), key=str(folder / "redis.key"))


def tls_settings(files: TlsFiles) -> dict[str, str]:
    return {"redis_tls_ca_file": files.ca, "redis_tls_cert_file": files.cert, "redis_tls_key_file": files.key}


def admin(stack: Stack, passwords: Path, command: str, *args: str, flags: tuple[str, ...] = ()) -> Any:
    """`tokenbus <command> ...`, logged in as the admin user with the flags an operator gives it; its JSON answer."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", command, "--redis-url", stack.url, "--redis-username", "tokenbus-admin",
         "--redis-password-file", str(passwords / "tokenbus-admin"), *flags, "--json", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def create_key(stack: Stack, passwords: Path, *flags: str) -> str:
    """A key made by `tokenbus keys create` as the admin user."""
    key: str = admin(stack, passwords, "keys", "create", "--tenant", "acl", flags=flags)["key"]
    return key


def openai_client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.edges[0].url + "/v1", api_key=key, max_retries=0, timeout=30)


async def stream(stack: Stack, key: str) -> tuple[str, str]:
    """A streamed chat's text, and the id of a stored response (read back)."""
    async with openai_client(stack, key) as client:
        chunks = await client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "one two three"}], max_tokens=5, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        stored = await client.responses.create(model=stack.model, input="one two", max_output_tokens=3)
        assert (await client.responses.retrieve(stored.id)).output_text == stored.output_text
    return text, stored.id


def assert_no_password_in_logs(stack: Stack, passwords: Path) -> None:
    logs = "".join(p.log.read_text() for p in [*stack.edges, *stack.workers])
    for user in USERS:
        assert password(passwords, user) not in logs


async def conversation_file_and_batch(stack: Stack, key: str) -> None:
    """The edge's other stores, as its user: a conversation, a batch file, and a batch of one line run to its
    end (its output file written)."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    async with openai_client(stack, key) as client:
        conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
        assert len([item async for item in client.conversations.items.list(conversation.id)]) == 1
        uploaded = await client.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        deadline = time.monotonic() + 30
        while (batch := await client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing"), batch
            await asyncio.sleep(0.1)
        assert batch.output_file_id and b'"custom_id":"a"' in (await client.files.content(batch.output_file_id)).content


async def test_each_user_of_the_deployed_acl_does_its_work_and_no_more(tmp_path: Path, passwords: Path) -> None:
    with Stack(tmp_path, secrets=passwords, login=worker_login(passwords)) as stack:
        stack.worker(sim_ttft_ms=1, sim_itl_ms=1, **login(passwords, "tokenbus-worker"))
        stack.edge(auth="keys", **login(passwords, "tokenbus-edge"))
        key = create_key(stack, passwords)
        text, stored = await stream(stack, key)
        assert len(text.split()) == 5
        await conversation_file_and_batch(stack, key)
        async with openai_client(stack, key) as client:  # noted for a revoke to find, under the edge's login
            background = await client.responses.create(model=stack.model, input="x", max_output_tokens=3,
                                                       background=True)
        with client_of(stack, passwords, "tokenbus-edge") as edge_login:
            assert any(edge_login.sismember(found, background.id)
                       for found in edge_login.scan_iter(keys.background_of_key("*")))
        deadline = time.monotonic() + 10  # the worker says what it holds with its next heartbeat
        while not list(stack.client.scan_iter(keys.prefixes(stack.model, "*"))):
            assert time.monotonic() < deadline, "the worker never wrote its prefix set"
            await asyncio.sleep(0.2)
        stack.redis.stop()  # what scripts and transactions wrote comes back from the append-only file
        stack.redis.start()
        async with openai_client(stack, key) as client:
            assert (await client.responses.retrieve(stored)).id == stored
        assert len((await stream(stack, key))[0].split()) == 5
        assert_no_password_in_logs(stack, passwords)
        added = admin(stack, passwords, "adapters", "add", "acl-adapter", "--base", stack.model, "--path", "/x")
        assert [a["name"] for a in admin(stack, passwords, "adapters", "list")] == [added["name"]]
        assert admin(stack, passwords, "adapters", "remove", "acl-adapter")["removed"] is True
        response = keys.stored_response("acl", "resp_x")
        denied: dict[str, list[tuple[Any, ...]]] = {
            "tokenbus-edge": [("HSET", keys.API_KEYS, "minted", "x"), ("SET", keys.api_key_by_hash("0" * 64), "x"),
                              ("HSET", keys.ADAPTERS, "planted", "x"),
                              ("FLUSHALL",), ("CONFIG", "SET", "maxmemory", "0"), ("KEYS", "*")],
            "tokenbus-worker": [("HGETALL", keys.API_KEYS), ("HSET", keys.ADAPTERS, "planted", "x"),
                                ("GET", response), ("FLUSHALL",), ("FLUSHDB",),
                                ("CONFIG", "GET", "*"), ("ACL", "LIST"), ("XADD", keys.job_record("j"), "*", "a", "b")],
            "tokenbus-admin": [("GET", response), ("XADD", keys.requests_stream(stack.model), "*", "a", "b"),
                               ("FLUSHALL",)],
        }
        for user, commands in denied.items():
            with client_of(stack, passwords, user) as client:
                for command in commands:
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        client.execute_command(*command)
        with redis.Redis.from_url(stack.url) as anonymous, pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()  # NOAUTH
        with redis.Redis.from_url(stack.url, username="tokenbus-health", password="any") as probe:
            assert probe.ping()
            with pytest.raises(redis.exceptions.NoPermissionError):
                probe.hgetall(keys.API_KEYS)
        for user in ("tokenbus-admin", "default"):
            with pytest.raises(redis.exceptions.AuthenticationError):
                redis.Redis.from_url(stack.url, username=user, password="guessed").ping()


async def test_a_stream_is_served_over_tls(tmp_path: Path, passwords: Path, tls: TlsFiles) -> None:
    """rediss:// everywhere, Redis asking each client for a certificate: the edge's pool and relay, the worker's
    pool, subscription and publisher (rawpipe's held connection), and `tokenbus keys`."""
    with Stack(tmp_path, secrets=passwords, tls=tls, login=worker_login(passwords)) as stack:
        assert stack.url.startswith("rediss://")
        stack.worker(sim_ttft_ms=1, sim_itl_ms=1, **login(passwords, "tokenbus-worker"), **tls_settings(tls))
        stack.edge(auth="keys", **login(passwords, "tokenbus-edge"), **tls_settings(tls))
        key = create_key(stack, passwords, "--redis-tls-ca-file", tls.ca, "--redis-tls-cert-file", tls.cert,
                         "--redis-tls-key-file", tls.key)
        assert len((await stream(stack, key))[0].split()) == 5
        assert_no_password_in_logs(stack, passwords)
        with pytest.raises((redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):  # TLS only
            redis.Redis(port=stack.redis.port, username="tokenbus-worker",
                        password=password(passwords, "tokenbus-worker"), socket_timeout=2).ping()


def test_a_password_file_logs_in_and_tls_files_go_to_rediss_only(tmp_path: Path) -> None:
    (tmp_path / "password").write_text("s3cret\r\n")
    access = redis_clients.Access(username="u", password_file=str(tmp_path / "password"), tls_ca_file="/ca.pem")
    assert redis_clients.login("rediss://h:6379/0", access) == {"username": "u", "password": "s3cret",
                                                                "ssl_ca_certs": "/ca.pem"}
    assert redis_clients.login("redis://h:6379/0", access) == {"username": "u", "password": "s3cret"}
    assert redis_clients.login("redis://h:6379/0", redis_clients.NO_ACCESS) == {}
