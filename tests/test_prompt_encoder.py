"""The worker's prompt tokenization: off the event loop, a burst in one call, ids exactly as the tokenizer's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.worker.models import default_chat_model_dir, default_embedding_model_dir
from services.worker.prompt_encoder import PromptEncoder

pytestmark = pytest.mark.engine  # the prepared default model's tokenizer

TEXTS = ["<|im_start|>user\nWhat time is it in Lima?<|im_end|>\n<|im_start|>assistant\n", "", "Once upon a time",
         "naïve café — 東京 🙂 " * 40, "  spaces\tand\nnewlines  "]


class CountingBackend:
    """The Rust tokenizer, counting the batches it is given."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.batches: list[int] = []

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> Any:
        self.batches.append(len(texts))
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
