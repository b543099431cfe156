"""TGI / MindIE text generation through the whole path, with huggingface_hub's InferenceClient."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

from tests.openapi import sse_events, validate
from tests.processes import GATHERING_MODEL, MODEL, Edge, WorkerProcess, start_edge, stop_process

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


def tgi_validate(component: str, instance: object) -> None:
    validate(component, instance, document="tgi-openapi.json")


@pytest.fixture
def hf(served: Edge) -> Iterator[InferenceClient]:
    yield InferenceClient(model=served.url, timeout=60)


@pytest.fixture(scope="module")
def plain_edge(redis_url: str, gathering_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Edge]:
    """An edge whose served model (TGI's) is GATHERING_MODEL, whose worker runs no LoRA adapters: it scores prompts
    (decoder_input_details), which MODEL's worker, serving adapters, refuses."""
    started = start_edge(redis_url, tmp_path_factory.mktemp("plain-edge"), model=GATHERING_MODEL)
    yield started
    stop_process(started.process)


@pytest.fixture
def hf_plain(plain_edge: Edge) -> Iterator[InferenceClient]:
    yield InferenceClient(model=plain_edge.url, timeout=60)


def test_greedy_generation_with_details(hf: InferenceClient) -> None:
    out = hf.text_generation(PROMPT, max_new_tokens=6, details=True)
    details = out.details
    assert details is not None
    assert "Paris" in out.generated_text
    assert details.finish_reason == "length" and details.generated_tokens == 6
    assert len(details.tokens) == 6
    assert "".join(t.text for t in details.tokens) == out.generated_text
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)
    assert details.seed is not None and details.seed > 0


def test_default_is_twenty_new_tokens_and_eos_ends_early(hf: InferenceClient) -> None:
    """A grammar whose text is complete leaves the model only its end-of-sequence token, in any dtype (greedy
    "Say hi." ends by itself in float32 but rambled past 200 tokens in bfloat16 on a GPU)."""
    out = hf.text_generation("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", details=True,
                             max_new_tokens=200, grammar={"type": "regex", "value": "Hi!"})
    assert out.generated_text == "Hi!"
    assert out.details is not None and out.details.finish_reason == "eos_token"
    assert out.details.tokens[-1].special is True
    default = hf.text_generation("Once upon a time", details=True)
    assert default.details is not None and default.details.generated_tokens <= 20


def test_stop_sequence_and_return_full_text(hf: InferenceClient) -> None:
    out = hf.text_generation(PROMPT, max_new_tokens=20, details=True, stop=["."], return_full_text=True)
    assert out.generated_text.startswith(PROMPT + " Paris")
    assert out.details is not None and out.details.finish_reason == "stop_sequence"


def test_streaming_ends_with_the_text_and_details(hf: InferenceClient) -> None:
    whole = hf.text_generation(PROMPT, max_new_tokens=8)
    events = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, 9))  # TGI counts its events from 1
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == whole == "".join(e.token.text for e in events)
    assert events[-1].details is not None and events[-1].details.generated_tokens == 8


def test_an_inference_client_made_with_a_url_chats_with_the_served_model(hf: InferenceClient) -> None:
    """Made with a URL, InferenceClient names no model ("dummy"; TGI's own clients send "tgi"): TGI serves its one
    model whatever the name, and here the edge's."""
    answer = hf.chat_completion([{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0)
    assert answer.model == MODEL and answer.choices[0].message.content
    streamed = list(hf.chat_completion([{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0,
                                       stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.choices[0].message.content


def test_parameters_sent_as_null_take_their_defaults(served: Edge) -> None:
    """TGI's schema lets every optional parameter be null (clients generated from it send them so)."""
    answer = httpx.post(served.url + "/generate", timeout=60, json={
        "inputs": PROMPT, "parameters": {"max_new_tokens": None, "return_full_text": None, "details": True,
                                         "do_sample": None, "seed": None, "stop": None, "truncate": None}})
    assert answer.status_code == 200, answer.text
    assert answer.json()["details"]["generated_tokens"] <= 20 and not answer.json()["generated_text"].startswith(PROMPT)


def test_decoder_input_details_scores_the_prompt(hf_plain: InferenceClient) -> None:
    out = hf_plain.text_generation(PROMPT, max_new_tokens=2, details=True, decoder_input_details=True)
    prefill = out.details.prefill if out.details else []
    assert "".join(t.text for t in prefill) == PROMPT
    assert prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in prefill[1:])


def test_a_model_served_with_adapters_refuses_decoder_input_details(hf: InferenceClient) -> None:
    """MODEL's worker serves LoRA adapters, beside which vLLM's prompt logprobs fail its engine core (vLLM issues
    29955, 16668): refused as TGI refuses a parameter, naming it; the same request without it is served."""
    with pytest.raises(ValidationError, match="decoder_input_details"):
        hf.text_generation(PROMPT, max_new_tokens=2, details=True, decoder_input_details=True)
    out = hf.text_generation(PROMPT, max_new_tokens=2, details=True)
    assert out.details is not None and out.details.generated_tokens >= 1


def test_a_seed_repeats_a_sample_and_is_returned(hf: InferenceClient) -> None:
    kwargs = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.0, "seed": 77, "details": True}
    first, second = hf.text_generation(PROMPT, **kwargs), hf.text_generation(PROMPT, **kwargs)
    assert first.generated_text == second.generated_text
    assert first.details is not None and first.details.seed == 77


def test_truncate_keeps_the_last_input_tokens(hf_plain: InferenceClient) -> None:
    out = hf_plain.text_generation("one two three four five six seven eight nine ten " * 5, max_new_tokens=1,
                             truncate=4, details=True, decoder_input_details=True)
    assert out.details is not None and len(out.details.prefill) == 4


def test_top_tokens_are_the_likeliest(hf: InferenceClient) -> None:
    out = hf.text_generation(PROMPT, max_new_tokens=3, details=True, top_n_tokens=3)
    assert out.details is not None and out.details.top_tokens is not None
    for token, top in zip(out.details.tokens, out.details.top_tokens, strict=True):
        ids = [t["id"] if isinstance(t, dict) else t.id for t in top]  # the client leaves these as dicts
        assert len(ids) == 3 and ids[0] == token.id


async def test_bodies_and_events_match_the_tgi_schema(served: Edge, gathering_worker: WorkerProcess) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        body = {"inputs": PROMPT, "model": GATHERING_MODEL,  # no adapters: it scores prompts
                "parameters": {"max_new_tokens": 3, "details": True, "decoder_input_details": True, "top_n_tokens": 2}}
        generated = (await http.post("/generate", json=body)).json()
        tgi_validate("GenerateResponse", generated)
        assert generated["details"]["prompt_tokens"] == 5
        compat = (await http.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})).json()
        assert isinstance(compat, list) and len(compat) == 1
        tgi_validate("GenerateResponse", compat[0])
        info = (await http.get("/info")).json()
        tgi_validate("Info", info)
        assert info["model_id"] == MODEL and info["max_total_tokens"] == 2048
    events = await sse_events(served.url + "/generate_stream",
                              {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}})
    for _name, data in events:
        tgi_validate("StreamResponse", data)
    streamed = await sse_events(served.url + "/",
                                {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3}})
    assert [d["token"] for _n, d in streamed] == [d["token"] for _n, d in events]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"inputs": PROMPT, "parameters": {"temperature": 0}}, 422, "temperature"),
        ({"inputs": PROMPT, "parameters": {"top_p": 1.0}}, 422, "top_p"),
        ({"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}, 422, "max_new_tokens"),
        ({"inputs": PROMPT, "parameters": {"stop": ["x"] * 1025}}, 422, "stop"),
        ({"inputs": ""}, 422, "inputs"),
        ({"inputs": "x" * (4 * 1024 * 1024 + 1)}, 422, "inputs"),
        ({"inputs": PROMPT, "stream": True, "parameters": {"decoder_input_details": True}}, 400,
         "decoder_input_details"),
        ({"inputs": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}, 400, "text only"),
        ({"inputs": [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": "/x.png"}]}, 400,
         "text only"),
    ],
)
async def test_errors_in_tgi_shape(served: Edge, body: dict[str, object], status: int, needle: str) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        reply = await http.post("/", json=body)
    assert reply.status_code == status
    error = reply.json()
    tgi_validate("ErrorResponse", error)
    assert error["error_type"] == "validation"
    assert needle in error["error"]


def test_adapter_none_means_the_base_model(hf: InferenceClient) -> None:
    plain = hf.text_generation(PROMPT, max_new_tokens=4)
    with_none = hf.text_generation(PROMPT, max_new_tokens=4, adapter_id="None")
    assert plain == with_none


def test_client_errors_reach_the_hf_client(hf: InferenceClient) -> None:
    # huggingface_hub turns TGI's 422 {"error_type": "validation"} into its own ValidationError
    with pytest.raises(ValidationError, match="max_new_tokens"):
        hf.text_generation(PROMPT, max_new_tokens=0)


async def test_the_mindie_sample_request_is_served(plain_edge: Edge) -> None:
    """MindIE's own sample (002): typical_p and watermark are accepted and, as MindIE documents, not applied;
    a list of text items reads as their text."""
    sample = {"inputs": "My name is Olivier and I", "parameters": {
        "decoder_input_details": True, "details": True, "do_sample": True, "max_new_tokens": 20,
        "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5, "top_k": 10,
        "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False, "stop": ["stop1", "stop2"],
        "adapter_id": "None"}, "stream": False}
    greedy = {"max_new_tokens": 8, "details": True}
    async with httpx.AsyncClient(base_url=plain_edge.url, timeout=60) as http:
        reply = await http.post("/", json=sample)
        as_items = await http.post("/generate", json={"inputs": [{"type": "text", "text": "My name is "},
                                                                  {"type": "text", "text": "Olivier and I"}],
                                                       "parameters": greedy})
        as_text = await http.post("/generate", json={"inputs": "My name is Olivier and I", "parameters": greedy})
    assert reply.status_code == 200, reply.text
    assert reply.json()[0]["details"]["generated_tokens"] >= 1
    assert as_items.status_code == 200
    assert as_items.json()["generated_text"] == as_text.json()["generated_text"]
