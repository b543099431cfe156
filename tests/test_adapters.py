"""LoRA adapters on the real engine: the adapter the worker was started with (--lora) and adapters added and
removed at run time with `tokenbus adapters`, each tenant's own visible to it alone, through the official SDKs."""

from __future__ import annotations

import json
import subprocess  # nosec B404: the tests run the operator's own command
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from huggingface_hub import InferenceClient

from shared.protocol import bus, keys
from tests.conftest import STATIC_ADAPTER
from tests.made_models import make_adapter
from tests.processes import MODEL, ROOT, Edge, WorkerProcess, metric_value, process_env, start_edge, stop_process

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def tokenbus(redis_url: str, *args: str) -> dict[str, object]:
    """Runs an operator's `tokenbus` command against the session's Redis; its JSON answer."""
    done = subprocess.run([sys.executable, "-m", "services.cli", *args[:1], "--json", *args[1:]],  # nosec B603
                          env=process_env(redis_url), cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


@pytest.fixture(scope="module")
def adapter_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(root / name, seed) for name, seed in (("acme-support", 11), ("globex-legal", 12))}


@pytest.fixture(scope="module")
def tenants(served: Edge, redis_url: str, adapter_folders: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Edge, dict[str, str]]]:
    """An edge that takes keys, two tenants' adapters added at run time, and a key of each tenant by name."""
    edge = start_edge(redis_url, tmp_path_factory.mktemp("keyed-edge"), name="keyed", auth="keys")
    for (name, folder), tenant in zip(adapter_folders.items(), ("acme", "globex"), strict=True):
        tokenbus(redis_url, "adapters", "add", name, "--base", MODEL, "--path", str(folder), "--tenant", tenant)
    made = {tenant: str(tokenbus(redis_url, "keys", "create", "--tenant", tenant)["key"])
            for tenant in ("acme", "globex")}
    made["acme-limited"] = str(tokenbus(redis_url, "keys", "create", "--tenant", "acme",
                                        "--models", "acme-support")["key"])
    try:
        yield edge, made
    finally:
        stop_process(edge.process)
        for name in adapter_folders:
            tokenbus(redis_url, "adapters", "remove", name)


def _client(edge: Edge, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=edge.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _answer(client: openai.OpenAI, model: str) -> str:
    completion = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert completion.model == model
    return completion.choices[0].message.content or ""


def _streamed(client: openai.OpenAI, model: str) -> str:
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_two_tenants_get_their_own_adapters_answers_and_404_for_the_others(
        tenants: tuple[Edge, dict[str, str]]) -> None:
    edge, made = tenants
    with _client(edge, made["acme"]) as acme, _client(edge, made["globex"]) as globex:
        base = _answer(acme, MODEL)
        acme_answer, globex_answer = _answer(acme, "acme-support"), _answer(globex, "globex-legal")
        assert len({base, acme_answer, globex_answer}) == 3, (base, acme_answer, globex_answer)
        assert _answer(acme, "acme-support") == acme_answer  # greedy: the same adapter answers the same
        assert _streamed(acme, "acme-support") == acme_answer
        for client, other in ((acme, "globex-legal"), (globex, "acme-support")):
            with pytest.raises(openai.NotFoundError) as refused:
                _answer(client, other)
            assert refused.value.status_code == 404 and "does not exist" in refused.value.message
        listed = {model.id: model for model in acme.models.list()}
        assert listed["acme-support"].model_extra["parent"] == MODEL
        assert "globex-legal" not in listed and MODEL in listed


def test_one_tenant_s_prompt_is_not_in_vllm_s_prefix_cache_for_another(
        tenants: tuple[Edge, dict[str, str]], worker: WorkerProcess) -> None:
    """vLLM answers a cached prompt sooner: another tenant sending the same long prompt (guessing a secret in it)
    finds none of its blocks cached (its cache_salt is its tenant), the tenant that sent it finds them."""
    edge, made = tenants
    prompt = "The vault code is 4711. " + " ".join(f"fact {i} is that the sea is deep." for i in range(40))

    def hits_after(key: str) -> float:
        with _client(edge, key) as client:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        time.sleep(1.5)  # vLLM reports its figures each engine step, and once a second when idle
        text = httpx.get(worker.metrics_url).text
        return metric_value(text, "tokenbus_worker_prefix_cache_hits_total", {"model": MODEL})

    before = hits_after(made["acme"])
    assert hits_after(made["globex"]) == before
    assert hits_after(made["acme"]) >= before + 256  # the prompt's blocks, all but the last


def test_a_key_limited_to_an_adapter_may_use_it_and_nothing_else(tenants: tuple[Edge, dict[str, str]]) -> None:
    edge, made = tenants
    with _client(edge, made["acme-limited"]) as limited, _client(edge, made["acme"]) as acme:
        assert _answer(limited, "acme-support") == _answer(acme, "acme-support")
        with pytest.raises(openai.NotFoundError):
            _answer(limited, MODEL)
        assert [model.id for model in limited.models.list()] == ["acme-support"]


def test_the_adapter_a_worker_was_started_with_is_served_to_everyone_and_reported(
        served: Edge, redis_client: redis.Redis) -> None:
    with _client(served) as client:
        assert _answer(client, STATIC_ADAPTER) != _answer(client, MODEL)
        listed = {model.id: model for model in client.models.list()}
    assert listed[STATIC_ADAPTER].model_extra["parent"] == MODEL
    beats = [bus.decode_info(raw) for name in redis_client.zrange(keys.WORKERS, 0, -1)
             if (raw := redis_client.get(name)) is not None]
    info = next(info for info in beats if info.model == MODEL)
    assert STATIC_ADAPTER in info.adapters and STATIC_ADAPTER in info.held and info.max_loras >= 1


def test_tgi_adapter_id_runs_the_adapter_as_the_openai_routes_do(served: Edge, redis_url: str,
                                                                 adapter_folders: dict[str, Path]) -> None:
    tokenbus(redis_url, "adapters", "add", "public-tgi", "--base", MODEL, "--path",
             str(adapter_folders["acme-support"]))
    try:
        hf = InferenceClient(served.url, timeout=60)
        adapted = hf.text_generation(PROMPT, max_new_tokens=8, adapter_id="public-tgi")
        assert adapted != hf.text_generation(PROMPT, max_new_tokens=8)
        with _client(served) as client:
            completion = client.completions.create(model="public-tgi", prompt=PROMPT, max_tokens=8, temperature=0)
        assert completion.choices[0].text == adapted
        refused = httpx.post(served.url + "/generate", timeout=30, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 2, "adapter_id": "no-such-adapter"}})
        assert refused.status_code == 404 and refused.json()["error_type"] == "not_found"
        assert "adapter `no-such-adapter`" in refused.json()["error"]
    finally:
        tokenbus(redis_url, "adapters", "remove", "public-tgi")


def test_an_adapter_removed_is_gone_within_a_refresh(served: Edge, redis_url: str,
                                                     adapter_folders: dict[str, Path]) -> None:
    tokenbus(redis_url, "adapters", "add", "short-lived", "--base", MODEL, "--path",
             str(adapter_folders["globex-legal"]))
    with _client(served) as client:
        assert _answer(client, "short-lived")
        assert tokenbus(redis_url, "adapters", "remove", "short-lived")["removed"] is True
        deadline = time.monotonic() + 10  # an edge reads the registry every heartbeat interval (2 s)
        while "short-lived" in {model.id for model in client.models.list()}:
            assert time.monotonic() < deadline, "the removed adapter is still listed"
            time.sleep(0.2)
        with pytest.raises(openai.NotFoundError):
            _answer(client, "short-lived")


def test_an_adapter_that_cannot_load_fails_its_request_alone(served: Edge, redis_url: str,
                                                              tmp_path: Path) -> None:
    """vLLM's engine core dies when a request names an adapter it cannot load: the worker loads it first."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8,
                                                            "target_modules": ["q_proj"]}))  # and no weights
    tokenbus(redis_url, "adapters", "add", "broken", "--base", MODEL, "--path", str(broken))
    try:
        with _client(served) as client:
            with pytest.raises(openai.APIStatusError) as failed:
                _answer(client, "broken")
            assert failed.value.status_code == 503 and "could not be loaded" in failed.value.message
            assert _answer(client, MODEL)  # the engine still serves
    finally:
        tokenbus(redis_url, "adapters", "remove", "broken")
