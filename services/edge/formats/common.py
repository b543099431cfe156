"""Request fields and conversions that several OpenAI formats share."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from services.edge.formats.base import Out, Request
from shared import bus
from shared.errors import InvalidRequest

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
PositiveInt = Annotated[int, Meta(gt=0)]
TopK = Annotated[int, Meta(ge=-1)]
"""vLLM's extension: 0 or -1 means no top-k filtering."""
RepetitionPenalty = Annotated[float, Meta(gt=0, le=2)]
N = Annotated[int, Meta(ge=1, le=16)]


class StreamOptions(Request):
    include_usage: bool = False


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's token-id strings to ints, each bias in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or not -100 <= value <= 100:
            raise InvalidRequest(
                f"`logit_bias` maps token ids to biases in [-100, 100]; {key!r}: {value!r} is not one.",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


class TopLogprobOut(Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(Out):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


def token_logprobs_out(logprobs: list[bus.TokenLogprob]) -> list[TokenLogprobOut]:
    """The chat (and Responses) logprob shape: token, logprob, UTF-8 bytes, top alternatives."""
    return [
        TokenLogprobOut(
            token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
            top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))
                          for t in lp.top],
        )
        for lp in logprobs
    ]
