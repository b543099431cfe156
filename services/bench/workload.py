"""What the load generator sends: prompt and output lengths from distributions, arrivals over time."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

# Common English words that SmolLM2's (and most BPE) tokenizers keep as one token each, with their space.
WORDS = ("the", "sea", "is", "deep", "and", "wide", "a", "ship", "sails", "on", "it", "at", "night", "under",
         "stars", "while", "birds", "sleep", "in", "trees")


@dataclass(frozen=True)
class Distribution:
    """`fixed:N`, `uniform:LOW-HIGH` or `normal:MEAN,STD` (clipped to at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Distribution:
        kind, _, args = text.partition(":")
        try:
            if kind == "fixed":
                return cls(kind, float(args))
            if kind == "uniform":
                low, high = args.split("-")
                return cls(kind, float(low), float(high))
            if kind == "normal":
                mean, std = args.split(",")
                return cls(kind, float(mean), float(std))
        except ValueError:
            pass
        raise ValueError(f"not a length distribution: {text!r} (fixed:N, uniform:LOW-HIGH, normal:MEAN,STD)")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:
            value = rng.gauss(self.a, self.b)
        return max(1, round(value))


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_words: int
    max_tokens: int


def prompt_of(words: int, rng: random.Random) -> str:
    """A prompt of about `words` tokens; a random start keeps prefix caching from helping one system."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def requests(count: int, prompt_len: Distribution, output_len: Distribution, seed: int) -> list[Request]:
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded workload
    out = []
    for _ in range(count):
        words = prompt_len.draw(rng)
        out.append(Request(prompt_of(words, rng), words, output_len.draw(rng)))
    return out


def poisson_gaps(rate: float, seed: int) -> Iterator[float]:
    """Seconds between arrivals of a Poisson process of `rate` requests per second (inf: all at once)."""
    rng = random.Random(seed)  # nosec B311: a benchmark's seeded workload
    while True:
        yield 0.0 if rate == float("inf") else rng.expovariate(rate)
