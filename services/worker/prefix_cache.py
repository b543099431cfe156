"""Prompt prefixes as a prefix cache holds them: a prompt's full blocks of BLOCK_TOKENS tokens, each named by a
hash chained to the block before it (as vLLM names its KV cache blocks), so that two prompts share a block's hash
exactly when they share everything up to its end; and an LRU cache of a fixed number of blocks.

The simulated engine's prefix cache is one (its prefills cost only the tokens it does not hold); a worker's
summary of what its engine holds is made of these hashes (see issue 38's cache-aware dispatch)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16
"""vLLM's default KV cache block size."""


def block_hashes(tokens: Sequence[int | str], block: int = BLOCK_TOKENS, salt: str = "") -> list[int]:
    """The chained hash of each full block of the tokens (token ids, or the simulated engine's words), in order:
    64 bits each, the same in every process; a salt goes into the first block's, as vLLM's cache_salt does."""
    hashes: list[int] = []
    parent = salt.encode() + b"\0" if salt else b""
    for start in range(0, len(tokens) - block + 1, block):
        digest = hashlib.blake2b(parent + "\x1f".join(map(str, tokens[start:start + block])).encode(),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


class PrefixCache:
    """Blocks by hash, the least recently used evicted first once `capacity` blocks are held (0: holds none)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queried = 0
        """Blocks looked up, in all."""
        self.hit = 0
        """Of those, blocks it held."""

    def held(self, hashes: Sequence[int]) -> int:
        """How many of the leading blocks it holds (a block counts only after all those before it), each
        touched as used."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.blocks:
                break
            self.blocks.move_to_end(block_hash)
            count += 1
        self.queried += len(hashes)
        self.hit += count
        return count

    def keep(self, hashes: Sequence[int]) -> None:
        """Holds a prompt's blocks (its prefill wrote them), evicting the least recently used past capacity."""
        if self.capacity <= 0:
            return
        for block_hash in hashes:
            self.blocks[block_hash] = None
            self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0
