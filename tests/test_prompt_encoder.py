"""The worker's prompt tokenization: off the event loop, a burst in one call, ids exactly as the tokenizer's own."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.worker.models import default_chat_model_dir, default_embedding_model_dir
from services.worker.prompt_encoder import CUT_MARGIN, LOOK_CHARS_PER_TOKEN, PromptEncoder

pytestmark = pytest.mark.engine  # the prepared default model's tokenizer

TEXTS = ["<|im_start|>user\nWhat time is it in Lima?<|im_end|>\n<|im_start|>assistant\n", "", "Once upon a time",
         "naïve café — 東京 🙂 " * 40, "  spaces\tand\nnewlines  "]


class CountingBackend:
    """The Rust tokenizer, counting the batches it is given and the characters it reads."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.batches: list[int] = []
        self.chars = 0

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> Any:
        self.batches.append(len(texts))
        self.chars += sum(map(len, texts))
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize("model_dir", [default_chat_model_dir(), default_embedding_model_dir()],
                         ids=["SmolLM2", "MiniLM"])
async def test_a_burst_of_prompts_is_tokenized_in_one_call_as_the_tokenizer_would(model_dir: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoder = PromptEncoder(tokenizer)
    counting = encoder.backend = CountingBackend(encoder.backend)
    asked = [(text, special) for special in (False, True) for text in TEXTS * 8]
    try:
        got = await asyncio.gather(*(encoder.encode(text, special) for text, special in asked))
        assert got == [tokenizer.encode(text, add_special_tokens=special) for text, special in asked]
        assert counting.batches == [len(TEXTS) * 8, len(TEXTS) * 8]  # one per add_special_tokens, not 80
        assert await encoder.encode("Paris", False) == tokenizer.encode("Paris", add_special_tokens=False)
        assert counting.batches[2:] == [1]  # a later turn of the loop is a batch of its own
    finally:
        encoder.close()


async def test_a_waiter_that_gives_up_leaves_the_others_their_ids() -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    encoder = PromptEncoder(tokenizer)
    try:
        tasks = [asyncio.create_task(encoder.encode(text, False)) for text in TEXTS]
        await asyncio.sleep(0)  # they have asked
        tasks[0].cancel()  # its job was cancelled meanwhile
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[0], asyncio.CancelledError)
        assert done[1:] == [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS[1:]]
    finally:
        encoder.close()


def prose(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocabulary = ["the", "sea", "is", "deep", "and", "wide,", "ships", "go", "over", "it.", "Night", "falls", "42"]
    return " ".join(rng.choices(vocabulary, k=words))


async def test_a_prompt_far_over_the_limit_is_refused_from_its_beginning_alone() -> None:
    """A megabyte that cannot fit 512 tokens costs the tokenizer a first look of 5 kB, not the megabyte (a second of
    the one thread every prompt waits for); a text that runs many characters a token is looked at further."""
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    encoder = PromptEncoder(tokenizer)
    counting = encoder.backend = CountingBackend(encoder.backend)
    try:
        assert await encoder.encode_within(prose(200_000), True, 512) is None
        assert counting.chars == (512 + CUT_MARGIN) * LOOK_CHARS_PER_TOKEN
        spaces = " " * 40_000 + "end"  # ~64 characters a token: 626 tokens, the first looks find too few
        assert await encoder.encode_within(spaces, True, 1000) == tokenizer.encode(spaces)
        counting.chars = 0
        assert await encoder.encode_within(" " * 1_000_000, True, 1000) is None
        assert counting.chars < 4 * 1000 * 64 * 2  # a few times the characters of 1,000 such tokens
        fits = prose(300)
        assert await encoder.encode_within(fits, False, 512) == tokenizer.encode(fits, add_special_tokens=False)
    finally:
        encoder.close()


@pytest.mark.parametrize("seed", range(3))
async def test_the_end_a_prompt_keeps_is_tokenized_as_the_whole_prompt_would_be(seed: int) -> None:
    """TGI's truncate keeps a prompt's last n tokens: the same ids as tokenizing all of it, from its end alone."""
    tokenizer = AutoTokenizer.from_pretrained(default_chat_model_dir())
    encoder = PromptEncoder(tokenizer)
    counting = encoder.backend = CountingBackend(encoder.backend)
    text = prose(100_000, seed) + " naïve café — 東京 🙂" * (seed * 50)
    whole = tokenizer.encode(text)
    try:
        for keep in (1, 100, 700):
            counting.chars = 0
            assert await encoder.encode_tail(text, True, keep) == whole[-keep:]
            assert counting.chars <= (keep + CUT_MARGIN) * LOOK_CHARS_PER_TOKEN  # one look, not the 500 kB
        short = prose(50, seed)
        assert await encoder.encode_tail(short, True, 700) == tokenizer.encode(short)  # all of it, BOS included
    finally:
        encoder.close()
