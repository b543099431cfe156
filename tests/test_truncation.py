"""Responses' truncation "auto" with SmolLM2's tokenizer and chat template, without an engine: which turns stay,
and that a long conversation takes a few renders, made off the event loop."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.worker import conversation
from services.worker.engine import COUNT_CONTEXTS, Counts, VllmEngine
from services.worker.models import default_chat_model_dir
from shared.protocol import bus
from shared.protocol.errors import ContextLengthExceeded
from shared.runtime.settings import Settings
from tests.test_prompt_encoder import CountingBackend

WORDS = ["the", "sea", "is", "deep", "and", "wide", "and", "ships", "go", "over", "it", "at", "night", "under", "stars"]


class CountingTokenizer:
    """SmolLM2's tokenizer, counting the chat template's renders and noting the threads they ran on and the
    characters of the messages they were given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: list[int] = []
        self.rendered_chars: list[int] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        self.threads.append(threading.get_ident())
        self.rendered_chars.append(sum(len(m["content"]) for m in messages))
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return AutoTokenizer.from_pretrained(default_chat_model_dir())


@pytest.fixture(scope="module")
def prepared(smollm2: Any) -> Iterator[VllmEngine]:
    engine = VllmEngine(Settings(max_model_len=512), default_chat_model_dir())
    engine.use_tokenizer(CountingTokenizer(smollm2))
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(prepared: VllmEngine) -> Iterator[VllmEngine]:
    prepared.tokenizer.threads.clear()
    prepared.tokenizer.rendered_chars.clear()
    prepared.max_model_len = 512
    assert prepared.encoder is not None
    backend = prepared.encoder.backend
    yield prepared
    prepared.encoder.backend = backend  # a test may count what it reads


def chat(messages: list[tuple[str, str]], max_tokens: int = 16) -> bus.Job:
    return bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, truncate=True,
                   messages=[bus.Message(role=role, content=content) for role, content in messages],
                   params=bus.SamplingParams(max_tokens=max_tokens))


def rendered(tokenizer: Any, messages: list[tuple[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def one_per_render(tokenizer: Any, messages: list[tuple[str, str]], room: int) -> list[int]:
    """The algorithm this replaces: render, and while too long drop the oldest turn but the system ones and the
    last (one render per dropped turn)."""
    messages = list(messages)
    while True:
        ids = rendered(tokenizer, messages)
        droppable = [i for i, (role, _) in enumerate(messages) if role != "system"][:-1]
        if len(ids) <= room or not droppable:
            return ids
        del messages[droppable[0]]


def conversation_of(rng: random.Random, turns: int, longest: int) -> list[tuple[str, str]]:
    """Alternating turns of random length, sometimes a system message first and one in the middle."""
    out = [("user" if i % 2 == 0 else "assistant", " ".join(rng.choices(WORDS, k=rng.randint(1, longest))))
           for i in range(turns)]
    if rng.random() < 0.5:
        out.insert(0, ("system", "Answer briefly."))
    if rng.random() < 0.5:
        out.insert(len(out) // 2, ("system", "Now answer in French."))  # a developer message, as the edge sends it
    return out


@pytest.mark.parametrize("seed", range(40))
async def test_the_same_turns_are_kept_as_when_one_was_dropped_per_render(
    engine: VllmEngine, smollm2: Any, seed: int
) -> None:
    rng = random.Random(seed)
    messages = conversation_of(rng, rng.randint(1, 30), rng.choice([5, 40, 300]))
    max_tokens = rng.choice([1, 16, 200, 480])
    [ids] = await engine.prompt_ids(chat(messages, max_tokens))
    assert ids == one_per_render(smollm2, messages, 512 - max_tokens)


async def test_system_messages_and_the_last_turn_stay_and_the_oldest_turns_go(
    engine: VllmEngine, smollm2: Any
) -> None:
    long = " ".join(WORDS * 12)  # 180 tokens
    messages = [("system", "Be brief."), ("user", long), ("assistant", long), ("system", "Answer in French."),
                ("user", long), ("assistant", "Oui."), ("user", "And the sea?")]
    counts = Counts()
    [ids] = await engine.prompt_ids(chat(messages, max_tokens=200), counts)
    assert ids == rendered(smollm2, [messages[0], messages[3], *messages[4:]])
    assert counts.dropped_messages == 2  # what the stored history leaves out
    [ids] = await engine.prompt_ids(chat(messages, max_tokens=300), counts)
    assert ids == rendered(smollm2, [messages[0], messages[3], *messages[5:]])
    assert counts.dropped_messages == 3


async def test_a_conversation_that_fits_is_rendered_once(engine: VllmEngine, smollm2: Any) -> None:
    messages = [("user", "Hi"), ("assistant", "Hello!"), ("user", "And the sea?")]
    [ids] = await engine.prompt_ids(chat(messages))
    assert ids == rendered(smollm2, messages)
    assert len(engine.tokenizer.threads) == 1


async def test_five_thousand_turns_take_a_few_renders_off_the_loop(engine: VllmEngine, smollm2: Any) -> None:
    rng = random.Random(5000)
    messages = [("system", "Answer briefly."), *conversation_of(rng, 5000, 20)]
    engine.max_model_len = 2048
    [ids] = await engine.prompt_ids(chat(messages, max_tokens=16))
    renders = engine.tokenizer.threads
    assert 2 <= len(renders) <= 4  # the whole, a guess and its neighbour; one per dropped turn was ~4,900
    assert threading.get_ident() not in renders  # a render of thousands of turns would hold the loop
    # the most turns that fit, found here by halving with the template itself
    first, last = 1, len(messages) - 1  # dropping messages[1:first] does not fit; dropping messages[1:last] does
    while last - first > 1:
        middle = (first + last) // 2
        fits = len(rendered(smollm2, [messages[0], *messages[middle:]])) <= 2048 - 16
        first, last = (first, middle) if fits else (middle, last)
    assert ids == rendered(smollm2, [messages[0], *messages[last:]])
    assert len(ids) <= 2048 - 16


async def test_turns_no_truncation_could_keep_are_never_rendered(engine: VllmEngine, smollm2: Any) -> None:
    """Eight megabytes of old turns before a short question: those no truncation could keep (more characters
    than 512 tokens of 256 each) dropped by their length alone, not rendered and tokenized (seconds of the one
    thread every prompt waits for) to find each too long; the newest three, which could fit by length, tried."""
    long = " ".join(WORDS * 600)  # 40 kB: more than 512 tokens of even 64 characters each
    messages = [("system", "Be brief."), *[("user" if i % 2 == 0 else "assistant", long) for i in range(200)],
                ("user", "And the sea?")]
    counts = Counts()
    [ids] = await engine.prompt_ids(chat(messages), counts)
    assert ids == rendered(smollm2, [messages[0], messages[-1]])
    assert counts.dropped_messages == 200
    assert engine.tokenizer.rendered_chars[0] == len("Be brief.") + 3 * len(long) + len("And the sea?")
    assert max(engine.tokenizer.rendered_chars) <= 512 * bus.MAX_TOKEN_CHARS


async def test_a_conversation_whose_kept_turns_cannot_fit_is_refused_before_it_is_rendered(
    engine: VllmEngine,
) -> None:
    huge = "sea " * (512 * bus.MAX_TOKEN_CHARS // 4 + 1)
    with pytest.raises(ContextLengthExceeded) as refused:
        await engine.prompt_ids(chat([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", huge)]))
    assert refused.value.param == "messages"
    assert engine.tokenizer.rendered_chars == []


def plain(prompt: str, kind: str = "completion", **fields: Any) -> bus.Job:
    return bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, kind=kind, prompts=[prompt],
                   params=bus.SamplingParams(max_tokens=16), **fields)


async def test_a_prompt_that_keeps_its_end_is_tokenized_from_its_end(engine: VllmEngine, smollm2: Any) -> None:
    """TGI's truncate and Databricks' error_behavior "truncate" on a megabyte: the ids the whole prompt ends with."""
    text = " ".join(random.Random(7).choices(WORDS, k=250_000))
    whole = smollm2.encode(text)
    counting = engine.encoder.backend = CountingBackend(engine.encoder.backend)
    assert await engine.prompt_ids(plain(text, keep_last_tokens=100)) == [whole[-100:]]
    assert await engine.prompt_ids(plain(text, truncate=True)) == [whole[-512:]]
    assert counting.chars < 100_000  # of the megabyte
    counting.chars = 0  # Databricks' templated completions: the template's end, as the engine gets it
    [templated] = await engine.prompt_ids(plain(text, truncate=True, chat_template=True))
    assert templated == rendered(smollm2, [("user", text)])[-512:]
    assert counting.chars < 100_000


@pytest.mark.parametrize(("kind", "param"), [("completion", "prompt"), ("chat", "messages"), ("embedding", "input")])
async def test_a_prompt_that_must_fit_whole_is_refused_from_its_beginning(
    engine: VllmEngine, kind: str, param: str
) -> None:
    text = " ".join(random.Random(8).choices(WORDS, k=250_000))
    job = (bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, messages=[bus.Message(role="user", content=text)])
           if kind == "chat" else plain(text, kind=kind))
    counting = engine.encoder.backend = CountingBackend(engine.encoder.backend)
    with pytest.raises(ContextLengthExceeded) as refused:
        await engine.prompt_ids(job)
    assert refused.value.param == param
    assert counting.chars < 100_000  # of the megabyte


def truncate(hidden: list[int], sizes: list[int], limit: int) -> tuple[int, int]:
    """Tokens of the prompt kept and renders made, for turns that take `hidden` tokens and are estimated at
    `sizes`."""
    messages = [{"role": "user", "content": "x"} for _ in hidden]

    def tokens(kept: list[dict[str, Any]]) -> list[int]:
        here = {id(m) for m in kept}
        return [0] * sum(cost for m, cost in zip(messages, hidden, strict=True) if id(m) in here)

    cut = conversation.Truncation(messages, sizes, tokens(messages), limit)
    renders = 1
    while (k := cut.next()) is not None:
        cut.record(k, tokens(cut.kept(k)))
        renders += 1
    assert cut.ids is not None
    return len(cut.ids), renders


@pytest.mark.parametrize("seed", range(60))
def test_an_estimate_that_misses_still_keeps_the_most_turns_that_fit(seed: int) -> None:
    """Turns that cost up to half more or less than their text says: the first guesses miss, later ones land."""
    rng = random.Random(seed)
    hidden = [rng.randint(5, 60) for _ in range(rng.randint(10, 3000))]
    sizes = [int(cost * rng.uniform(0.5, 1.5)) for cost in hidden]
    limit = rng.randint(100, sum(hidden) - 1)
    kept, renders = truncate(hidden, sizes, limit)
    suffix = 0  # the longest run of newest turns that fits: what dropping one turn per render kept
    for cost in reversed(hidden[:-1]):
        if suffix + cost + hidden[-1] > limit:
            break
        suffix += cost
    assert kept == suffix + hidden[-1]
    assert renders <= 7


@pytest.mark.parametrize("seed", range(20))
def test_turns_that_do_not_add_up_still_end_within_the_bound(seed: int) -> None:
    """Turns whose cost their text does not tell: guesses miss, halving ends it, and what is kept fits."""
    rng = random.Random(seed)
    hidden = [rng.choice([1, 50, 400]) for _ in range(1000)]
    limit = rng.randint(1000, sum(hidden) - 1)
    kept, renders = truncate(hidden, [1] * len(hidden), limit)
    assert kept <= limit
    assert renders <= 7  # MAX_RENDERS, stated here so that raising it is seen


class _CountingSpans(CountingBackend):
    """Counts the characters encoded with offsets too (TGI's /tokenize)."""

    def encode(self, text: str, add_special_tokens: bool) -> Any:
        self.chars += len(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("chat_kind", [False, True], ids=["prompt", "messages"])
async def test_tokenize_answers_a_prompt_that_fits_the_context_and_refuses_a_longer_one_from_its_beginning(
    engine: VllmEngine, smollm2: Any, chat_kind: bool
) -> None:
    """/tokenize's answer is bounded by the context, not by the body: 524,288 digits are 524,288 tokens (a 7 MB
    event, over a second of the worker's loop); refused after reading a few times the context's characters."""
    def job(text: str) -> bus.Job:
        if chat_kind:
            return bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, kind="chat", count_only=True,
                           tokens_out=True, messages=[bus.Message(role="user", content=text)],
                           params=bus.SamplingParams(max_tokens=1))
        return plain(text, count_only=True, tokens_out=True)

    fits = " ".join(random.Random(9).choices(WORDS, k=400))
    answer = await engine._tokens_out(job(fits))
    if not chat_kind:
        assert answer.token_ids == smollm2.encode(fits)
        assert [fits[a:b] for a, b in answer.spans][1:] == [
            s.replace("Ġ", " ") for s in smollm2.convert_ids_to_tokens(answer.token_ids)][1:]
    assert len(answer.token_ids) <= engine.max_model_len
    counting = engine.encoder.backend = _CountingSpans(engine.encoder.backend)
    with pytest.raises(ContextLengthExceeded) as refused:
        await engine._tokens_out(job("1 " * 262_144))
    assert refused.value.param == ("messages" if chat_kind else "prompt")
    assert counting.chars < 100_000  # of the 524,288


@pytest.mark.parametrize(("kind", "param"), [("completion", "prompt"), ("chat", "messages")])
async def test_a_count_is_exact_to_a_few_contexts_and_refused_past_them_from_its_beginning(
    engine: VllmEngine, smollm2: Any, kind: str, param: str
) -> None:
    """count_tokens and input_tokens: a prompt twice the context is counted exactly (a client learns how far over
    it is); one of 524,288 tokens is refused after a few times COUNT_CONTEXTS contexts' characters."""
    def job(text: str) -> bus.Job:
        if kind == "chat":
            return bus.Job(id="j", model="m", reply_to="r", deadline_ms=0, kind="chat", count_only=True,
                           messages=[bus.Message(role="user", content=text)], params=bus.SamplingParams(max_tokens=1))
        return plain(text, count_only=True)

    over = " ".join(random.Random(10).choices(WORDS, k=engine.max_model_len * 2))
    [counted] = await engine.prompt_ids(job(over))
    assert len(counted) >= engine.max_model_len * 2
    if kind == "completion":
        assert counted == smollm2.encode(over)
    counting = engine.encoder.backend = CountingBackend(engine.encoder.backend)
    with pytest.raises(ContextLengthExceeded) as refused:
        await engine.prompt_ids(job("1 " * 262_144))
    assert refused.value.param == param and str(COUNT_CONTEXTS * engine.max_model_len) in refused.value.message
    assert counting.chars < COUNT_CONTEXTS * engine.max_model_len * 40  # of the 524,288
