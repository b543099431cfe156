"""Prompt tokenization off the worker's event loop, the prompts of a burst in one call.

Tokenizing a chat prompt costs the worker time in proportion to its length. Done inline, a pull of 32 jobs held
the loop that streams every running job's tokens for all their tokenizations in a row, and the jobs reached the
engine one by one, spread over its steps; vllm serve tokenizes in a thread pool for the same reason. Here the
prompts asked for in one turn of the loop go to one thread as one `encode_batch` of the Rust tokenizer, which
releases the GIL while it works.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from shared.protocol.errors import NotFound

_Waiting = list[tuple[str, "asyncio.Future[list[int]]"]]

LOOK_CHARS_PER_TOKEN = 8
"""How far a first look into a long text reads, in characters per token it looks for: prose and code run 3 to 6
characters a token, so one look usually settles it; a text that runs longer (runs of spaces) is read again, four
times as far each time."""
CUT_MARGIN = 64
"""Tokens by which a text cut short may tokenize differently near the cut than the whole text there."""


class PromptEncoder:
    """Token ids of prompt texts, as `tokenizer.encode(text, add_special_tokens=...)` gives them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend: Any = _own_copy(getattr(tokenizer, "backend_tokenizer", None))
        """A copy of a Hugging Face fast tokenizer's Rust tokenizer (the loop detokenizes with the original while
        the thread encodes); None for any other tokenizer, which encodes inline."""
        self.waiting: dict[bool, _Waiting] = {}
        """Texts asked for in this turn of the loop, by add_special_tokens."""
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        loop = asyncio.get_running_loop()
        if not self.waiting:
            loop.call_soon(self._flush)
        future: asyncio.Future[list[int]] = loop.create_future()
        self.waiting.setdefault(add_special_tokens, []).append((text, future))
        return await future

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of many texts in one call of the thread (one future, where `encode` makes one a text)."""
        if self.backend is None:
            return [list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)) for text in texts]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._encode_batch, texts, add_special_tokens)

    async def encode_with_spans(self, text: str, add_special_tokens: bool,
                                limit: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The text's ids and each token's start and end in it, in characters (TGI's /tokenize), off the loop; None
        once it has more than `limit` tokens, found as `encode_within` finds it: a megabyte that a tokenizer makes two
        million tokens of cost the worker's loop seconds to list and the edge a gigabyte to answer."""
        if self.backend is None:  # only a fast (Rust) tokenizer gives spans, as TGI answers too
            raise NotFound("No fast tokenizer available: this model's tokenizer gives no token spans.")
        if (len(text) > (limit + CUT_MARGIN) * LOOK_CHARS_PER_TOKEN
                and await self.encode_within(text, add_special_tokens, limit) is None):
            return None
        ids, spans = await asyncio.get_running_loop().run_in_executor(
            self.executor, self._encode_with_spans, text, add_special_tokens)
        return None if len(ids) > limit else (ids, spans)

    def _encode_with_spans(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]

    async def encode_within(self, text: str, add_special_tokens: bool, limit: int) -> list[int] | None:
        """The text's ids, or None once its beginning alone has more than `limit` tokens: a text far over the limit
        costs the tokenizer a few times the characters of `limit` tokens, not its whole length."""
        reach = (limit + CUT_MARGIN) * LOOK_CHARS_PER_TOKEN
        while len(text) > reach:
            if len(await self.encode(text[:reach], add_special_tokens)) > limit + CUT_MARGIN:
                return None
            reach *= 4
        return await self.encode(text, add_special_tokens)

    async def encode_tail(self, text: str, add_special_tokens: bool, keep: int) -> list[int]:
        """Ids that end with the text's last `keep` tokens (all its ids when it has fewer), from only as much of its
        end as they need. A text cut inside a word longer than the cut's margin may split that word otherwise."""
        reach = (keep + CUT_MARGIN) * LOOK_CHARS_PER_TOKEN
        while len(text) > reach:
            tail = await self.encode(text[-reach:], add_special_tokens=False)
            if len(tail) >= keep + CUT_MARGIN:
                return tail[-keep:]
            reach *= 4
        return await self.encode(text, add_special_tokens)

    def _flush(self) -> None:
        waiting, self.waiting = self.waiting, {}
        loop = asyncio.get_running_loop()
        for special, items in waiting.items():
            batch = loop.run_in_executor(self.executor, self._encode_batch, [text for text, _ in items], special)
            batch.add_done_callback(partial(_deliver, [future for _, future in items]))

    def _encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _own_copy(backend: Any) -> Any:
    """The Rust tokenizer anew, without the padding and truncation its file may set (MiniLM's pads to 128),
    which `tokenizer.encode` turns off for each call."""
    if backend is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy


def _deliver(futures: list[asyncio.Future[list[int]]], batch: asyncio.Future[list[list[int]]]) -> None:
    """Each waiter's ids, or the batch's failure; a waiter that gave up (its job was cancelled) is skipped."""
    for i, future in enumerate(futures):
        if future.done():
            continue
        if batch.cancelled():
            future.cancel()
        elif (failed := batch.exception()) is not None:
            future.set_exception(failed)
        else:
            future.set_result(batch.result()[i])
