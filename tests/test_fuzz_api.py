"""The whole HTTP API under hostile input, against a running edge and a simulated worker: schemathesis from
/openapi.json, a hand-written hostile set over every POST route, and clients that send a byte a second.
Every answer is a success or a 4xx in its route's error shape, within seconds; none is a 5xx, none hangs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from services.edge.routes import api_document as document
from tests.processes import Edge, running_worker, start_edge, stop_process

SIM_MODEL = "fuzz-sim"
MAX_MODEL_LEN = 64
"""Small, so that a fuzzed request that the edge accepts is also a short one."""
READ_TIMEOUT_S = 3
ANSWER_WITHIN_S = 5.0
EXAMPLES = 12
"""Per operation and generation mode: 17 operations, 12 of them with a body to spoil, about 350 requests."""
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
TGI_PATHS = frozenset({"/", "/generate", "/generate_stream", "/info"})

PATHS: dict[str, Any] = json.loads(document())["paths"]
FUZZED = [(path, method.upper(), mode) for path, methods in PATHS.items() for method, operation in methods.items()
          for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
          if mode is GenerationMode.POSITIVE or "requestBody" in operation]
"""Every operation with valid input, and with invalid input where it has a body (a path's free-form
string parameter cannot be invalid)."""
POST_ROUTES = [path.replace("{name}", SIM_MODEL) for path, methods in PATHS.items() if "post" in methods]


@pytest.fixture(scope="module")
def api(redis_url: str, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    """An edge whose TGI routes serve the simulated model, with short read deadlines."""
    root: Path = tmp_path_factory.mktemp("fuzz")
    with running_worker(redis_url, redis_client, root / "worker.log", SIM_MODEL, engine="sim", sim_ttft_ms=1,
                        sim_itl_ms=1, max_model_len=MAX_MODEL_LEN):
        edge = start_edge(redis_url, root, "fuzz-edge", model=SIM_MODEL, read_timeout_s=READ_TIMEOUT_S)
        try:
            yield edge
        finally:
            stop_process(edge.process)


def _five_hundreds(edge: Edge) -> dict[str, float]:
    """The edge's own count of 5xx answers, by route (a client may not have seen them all)."""
    text = httpx.get(edge.metrics_url, timeout=5).text
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line.startswith("tokenbus_edge_requests_total{") and 'status="5' in line}


@pytest.fixture(autouse=True)
def no_5xx(api: Edge) -> Iterator[None]:
    before = _five_hundreds(api)
    yield
    assert _five_hundreds(api) == before


def assert_error_shape(path: str, status: int, body: Any) -> None:
    """TGI's routes answer {"error", "error_type"}; Anthropic's {"type": "error", "error": {"type", "message"}}; the
    others, and what the parser refuses before any route is known, OpenAI's {"error": {"message", "type", "param",
    "code"}}."""
    assert 400 <= status < 500, (status, body)
    if path in TGI_PATHS and status not in (414, 431):
        assert isinstance(body["error"], str) and isinstance(body["error_type"], str), body
    elif path in ANTHROPIC_PATHS and status not in (414, 431):
        assert body["type"] == "error" and body["error"].keys() == {"type", "message"}, body
        assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str), body
    else:
        error = body["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
        assert {"param", "code"} <= error.keys(), body


def _sse_payloads(text: str) -> list[Any]:
    payloads = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return [json.loads(payload) for payload in payloads if payload != "[DONE]"]


# schemathesis


@pytest.fixture(scope="module")
def schema(api: Edge) -> Any:
    return schemathesis.openapi.from_url(api.url + "/openapi.json")


def _aim_at_the_simulated_model(case: Any) -> None:
    # random model names would all be 404s before any field is looked at
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = SIM_MODEL
    if case.path_parameters and "name" in case.path_parameters:
        case.path_parameters["name"] = SIM_MODEL


@pytest.mark.parametrize(("path", "method", "mode"), FUZZED)
def test_schemathesis_finds_no_5xx_and_every_answer_parses(
    api: Edge, schema: Any, path: str, method: str, mode: GenerationMode
) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        _aim_at_the_simulated_model(case)
        response = case.call(base_url=api.url, timeout=30)
        assert response.status_code < 500, (response.status_code, response.text[:500])
        if "text/event-stream" in str(response.headers.get("content-type")):
            _sse_payloads(response.text)
        else:
            body = response.json()
            if response.status_code >= 400:
                assert_error_shape(path, response.status_code, body)

    check()


# a hand-written hostile set


BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": SIM_MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "completions": {"model": SIM_MODEL, "prompt": "Hi"},
    "responses": {"model": SIM_MODEL, "input": "Hi"},
    "embeddings": {"model": SIM_MODEL, "input": "Hi"},
    "tgi": {"inputs": "Hi", "parameters": {}},
}
SEED = {"chat": "seed", "completions": "seed", "tgi": "parameters.seed"}
BUDGET = {"chat": "max_tokens", "completions": "max_tokens", "responses": "max_output_tokens",
          "tgi": "parameters.max_new_tokens", "embeddings": "dimensions"}
"""A field whose huge values must be refused: the token budget (embeddings have none: their dimensions)."""
TEXT = {"chat": "messages", "completions": "prompt", "responses": "input", "embeddings": "input", "tgi": "inputs"}
DEEP = b"[" * 10_000 + b"]" * 10_000


def _kind(route: str) -> str:
    if route in TGI_PATHS:
        return "tgi"
    if route.endswith("/invocations") or route.endswith("/chat/completions"):
        return "chat"
    return route.rsplit("/", 1)[-1]


def _with(body: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {**body, head: _with(body[head], rest, value) if rest else value}


def _raw(body: dict[str, Any], dotted: str, literal: bytes) -> bytes:
    """The body with a field set to JSON text that no encoder writes (1e400, 5000 digits, bytes)."""
    return json.dumps(_with(body, dotted, "@@")).encode().replace(b'"@@"', literal)


def hostile_requests(kind: str) -> dict[str, tuple[bytes, dict[str, str]]]:
    """name -> (body, headers) of requests every route of a kind must refuse with a 4xx."""
    base = BODIES[kind]
    cases: dict[str, bytes] = {
        "invalid UTF-8": json.dumps(base).encode().replace(b'"Hi"', b'"\xff\xfeHi"'),
        "escaped lone surrogate": json.dumps(base).encode().replace(b'"Hi"', b'"\\ud800"'),
        "unknown field named in invalid UTF-8": json.dumps({**base, "@@": 1}).encode().replace(b'"@@"', b'"\xff"'),
        "huge number": _raw(base, BUDGET[kind], str(2**80).encode()),
        "5000-digit number": _raw(base, BUDGET[kind], b"9" * 5000),
        "float overflow": _raw(base, BUDGET[kind], b"1e400"),
        "NaN": _raw(base, BUDGET[kind], b"NaN"),
        "wrong type": json.dumps({**base, TEXT[kind]: 5}).encode(),
        "empty body": b"",
        "array body": b"[]",
        "string body": b'"Hi"',
        "null body": b"null",
        "10k-deep nested arrays": DEEP,
        "10k-deep nested field": _raw(base, "nested", DEEP),
    }
    if kind in SEED:
        cases["seed 2**80"] = _raw(base, SEED[kind], str(2**80).encode())
    if kind != "embeddings":
        cases["max_tokens 10**15"] = _raw(base, BUDGET[kind], str(10**15).encode())
    requests: dict[str, tuple[bytes, dict[str, str]]] = {name: (body, {}) for name, body in cases.items()}
    requests["100 kB header"] = (json.dumps(base).encode(), {"x-filler": "a" * 100_000})
    return requests


HOSTILE = [(route, name) for route in POST_ROUTES if _kind(route) in BODIES for name in hostile_requests(_kind(route))]
"""The generation routes' (the others, conversations and cancels, are in FUZZED)."""


@pytest.mark.parametrize(("route", "name"), HOSTILE)
async def test_hostile_requests_get_a_4xx_in_the_route_error_shape_within_seconds(
    api: Edge, route: str, name: str
) -> None:
    body, headers = hostile_requests(_kind(route))[name]
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        response = await http.post(api.url + route, content=body,
                                   headers={"content-type": "application/json", **headers})
    assert time.monotonic() - started < ANSWER_WITHIN_S
    assert_error_shape(route, response.status_code, response.json())
    if name == "100 kB header":
        assert response.status_code == 431
    if name == "max_tokens 10**15" and route not in TGI_PATHS:
        assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_more_stop_strings_than_the_edge_serves_are_refused_naming_the_field(api: Edge) -> None:
    """The engine checks every stop string on every token, on the loop that streams everyone's tokens: more than
    --max-stop-sequences (16, as /info reports) is the caller's error, on every route."""
    stops = [f"stop{i}" for i in range(17)]
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        info = (await http.get(api.url + "/info")).json()
        served = await http.post(api.url + "/v1/chat/completions", json={
            "model": SIM_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stop": stops[:16]})
        refused = {
            "stop": await http.post(api.url + "/v1/chat/completions", json={
                "model": SIM_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stop": stops}),
            "parameters.stop": await http.post(api.url + "/generate", json={
                "inputs": "Hi", "parameters": {"max_new_tokens": 2, "stop": stops}}),
            "stop_sequences": await http.post(api.url + "/v1/messages", json={
                "model": SIM_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                "stop_sequences": stops}),
        }
    assert info["max_stop_sequences"] == 16
    assert served.status_code == 200, served.text
    assert refused["stop"].status_code == 400 and refused["stop"].json()["error"]["param"] == "stop"
    assert refused["parameters.stop"].status_code == 422 and "16" in refused["parameters.stop"].json()["error"]
    assert refused["stop_sequences"].status_code == 400 and "16" in refused["stop_sequences"].text


@pytest.mark.parametrize("route", ["/generate", "/v1/messages", "/v1/chat/completions"])
async def test_a_method_a_path_does_not_serve_is_a_405_in_its_family_s_shape(api: Edge, route: str) -> None:
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        refused = await http.get(api.url + route)
    assert refused.status_code == 405
    assert_error_shape(route, refused.status_code, refused.json())


@pytest.mark.parametrize("route", ["/generate", "/", "/v1/chat/completions"])
async def test_a_body_over_the_limit_is_a_413_in_the_route_shape(api: Edge, route: str) -> None:
    body = json.dumps({"inputs": "x" * (8 * 1024 * 1024), "model": SIM_MODEL, "messages": []}).encode()
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        refused = await http.post(api.url + route, content=body, headers={"content-type": "application/json"})
    assert refused.status_code == 413
    assert_error_shape(route, refused.status_code, refused.json())


async def test_a_budget_beyond_the_context_is_refused_at_the_edge_but_truncate_returns_what_fits(api: Edge) -> None:
    url = api.url + "/v1/completions"
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        refused = await http.post(url, json={"model": SIM_MODEL, "prompt": "Hi", "max_tokens": MAX_MODEL_LEN})
        fitted = await http.post(url, json={"model": SIM_MODEL, "prompt": "Hi", "max_tokens": MAX_MODEL_LEN,
                                            "error_behavior": "truncate"})
        fits = await http.post(url, json={"model": SIM_MODEL, "prompt": "Hi", "max_tokens": MAX_MODEL_LEN - 1})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "max_tokens"
    assert fitted.status_code == 200
    assert fits.status_code == 200


async def test_a_prompt_no_tokenizer_could_fit_in_the_context_is_refused_at_the_edge(api: Edge) -> None:
    """More characters than the context's tokens could spell (256 each at most): refused at once, not tokenized on
    the worker's one tokenizing thread (a second per MiB, while every other prompt waits); one that truncates is
    the worker's to cut, unless what truncation keeps (a conversation's last turn) is that long."""
    text = "word " * (MAX_MODEL_LEN * 256 // 5 + 1)
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        chat = await http.post(api.url + "/v1/chat/completions", json={
            "model": SIM_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
        completion = await http.post(api.url + "/v1/completions", json={
            "model": SIM_MODEL, "prompt": ["Hi", text], "max_tokens": 2})
        truncated = await http.post(api.url + "/v1/completions", json={
            "model": SIM_MODEL, "prompt": text, "max_tokens": 2, "error_behavior": "truncate"})
        old_turns = await http.post(api.url + "/v1/responses", json={
            "model": SIM_MODEL, "truncation": "auto", "max_output_tokens": 2,
            "input": [{"role": "user", "content": text}, {"role": "assistant", "content": "Hm."},
                      {"role": "user", "content": "Hi"}]})
        last_turn = await http.post(api.url + "/v1/responses", json={
            "model": SIM_MODEL, "truncation": "auto", "max_output_tokens": 2,
            "input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hm."},
                      {"role": "user", "content": text}]})
    assert old_turns.status_code == 200, old_turns.text  # truncation drops them
    assert (last_turn.status_code, last_turn.json()["error"]["code"]) == (400, "context_length_exceeded")  # it keeps it
    for refused, param in ((chat, "messages"), (completion, "prompt")):
        assert refused.status_code == 400, refused.text
        assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == ("context_length_exceeded", param)
    assert truncated.status_code == 200, truncated.text


# slow clients


async def _read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent before it closed: a reset that follows an answer (the client was still
    dripping bytes into a closed socket) does not undo the answer."""
    received = bytearray()
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            received += chunk
    return bytes(received)


async def _drip(writer: asyncio.StreamWriter, first: bytes) -> None:
    """Sends `first`, then one byte a second, until the server closes the connection."""
    writer.write(first)
    with contextlib.suppress(ConnectionError):
        while True:
            await writer.drain()
            await asyncio.sleep(1)
            writer.write(b"a")


async def _slow_client(port: int, first: bytes) -> tuple[float, bytes]:
    """How long the server kept a dripping connection open, and what it answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    dripping = asyncio.create_task(_drip(writer, first))
    try:
        answer = await asyncio.wait_for(_read_until_closed(reader), READ_TIMEOUT_S + 5)
        return time.monotonic() - started, answer
    finally:
        dripping.cancel()
        writer.close()


async def test_half_sent_request_lines_are_dropped_while_others_are_served(api: Edge) -> None:
    port = httpx.URL(api.url).port or 80
    slow = [asyncio.create_task(_slow_client(port, b"POST /v1/chat/comp")) for _ in range(50)]
    await asyncio.sleep(1)
    async with httpx.AsyncClient(timeout=ANSWER_WITHIN_S) as http:
        served = await http.post(api.url + "/v1/chat/completions",
                                 json={**BODIES["chat"], "max_tokens": 4})
    assert served.status_code == 200
    assert served.json()["usage"]["completion_tokens"] == 4
    dropped = await asyncio.gather(*slow)
    assert all(answer == b"" for _held, answer in dropped)
    assert max(held for held, _answer in dropped) < READ_TIMEOUT_S + 1.5


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate"])
async def test_a_body_sent_a_byte_a_second_is_refused_in_the_route_error_shape(api: Edge, route: str) -> None:
    head = (f"POST {route} HTTP/1.1\r\nHost: tokenbus\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{").encode()
    port = httpx.URL(api.url).port or 80
    answers = await asyncio.gather(*(_slow_client(port, head) for _ in range(5)))
    for held, answer in answers:
        assert held < READ_TIMEOUT_S + 1.5
        status_line, _, rest = answer.partition(b"\r\n")
        status = int(status_line.split()[1])
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert_error_shape(route, status, body)
