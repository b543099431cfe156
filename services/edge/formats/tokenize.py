"""Tokenizing on the served model's tokenizer, running nothing: vLLM's POST /tokenize (a prompt, or chat messages
through the chat template) and POST /detokenize, and TGI's POST /tokenize (`inputs`, each token with its span).
One path serves vLLM's and TGI's /tokenize: a body with `inputs` is TGI's. The worker tokenizes (a count_only job
with tokens_out: bus.Prompt carries the answer); the edge knows no tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.edge.formats import chat
from services.edge.formats.base import Out, PromptCount, Request, openai_error_body, refuse
from services.edge.formats.common import INT32_MAX
from shared.protocol import bus
from shared.protocol.errors import TokenbusError

TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]


class TokenizePromptRequest(Request, kw_only=True):
    """vLLM's TokenizeCompletionRequest."""

    model: str = ""
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(chat.ChatCompletionRequest, kw_only=True):
    """vLLM's TokenizeChatRequest: messages (and tools) through the model's chat template."""

    model: str = ""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Request, kw_only=True):
    model: str = ""
    tokens: Annotated[list[TokenId], Meta(min_length=1)]


class TokenizeResponse(Out, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Out, kw_only=True):
    prompt: str


class SimpleToken(Out, kw_only=True):
    """TGI's: a token and where it is in the inputs."""

    id: int
    text: str
    start: int
    stop: int


def _counting(model: str, *, job_id: str, reply_to: str, deadline_ms: int, **fields: Any) -> bus.Job:
    """A job that tokenizes and runs nothing (one output token in its budget, which admission charges and the
    count settles, as count_tokens)."""
    return bus.Job(id=job_id, model=model, reply_to=reply_to, deadline_ms=deadline_ms, count_only=True,
                   tokens_out=True, params=bus.SamplingParams(max_tokens=1), created_ms=bus.now_ms(), **fields)


def prompt_job(req: TokenizePromptRequest, **ids: Any) -> bus.Job:
    return _counting(req.model, kind="completion", prompts=[req.prompt], add_special_tokens=req.add_special_tokens,
                     **ids)


def chat_job(req: TokenizeChatRequest, **ids: Any) -> bus.Job:
    if req.continue_final_message:
        raise refuse("continue_final_message", "the final message is not continued here")
    if req.add_special_tokens:
        raise refuse("add_special_tokens", "the chat template places the model's special tokens itself")
    job = chat.to_job(req, **ids)
    return msgspec.structs.replace(job, count_only=True, tokens_out=True, params=bus.SamplingParams(max_tokens=1),
                                   add_generation_prompt=req.add_generation_prompt)


def ids_job(req: DetokenizeRequest, **ids: Any) -> bus.Job:
    return _counting(req.model, kind="completion", prompts=[""], prompt_ids=[req.tokens], **ids)


class TokensRenderer(PromptCount):
    """The worker's Prompt event of a tokens_out job, shaped by `shape`."""

    def __init__(self, shape: Callable[[bus.Prompt], Any], error_shape: Callable[[TokenbusError], Any]) -> None:
        super().__init__(lambda _count: shape(self.prompt), error_shape)
        self.prompt = bus.Prompt(job="", index=0, token_ids=[])

    def render(self, event: bus.Output) -> list[Any]:
        if isinstance(event, bus.Prompt):
            self.prompt = event
        return super().render(event)


def tokenized(max_model_len: int, token_strs: bool) -> TokensRenderer:
    return TokensRenderer(lambda found: TokenizeResponse(
        count=len(found.token_ids), max_model_len=max_model_len, tokens=found.token_ids,
        token_strs=found.token_strs if token_strs else None), openai_error_body)


def detokenized() -> TokensRenderer:
    return TokensRenderer(lambda found: DetokenizeResponse(prompt=found.text), openai_error_body)


def tgi_tokenized(inputs: str, error_shape: Callable[[TokenbusError], Any]) -> TokensRenderer:
    return TokensRenderer(lambda found: [
        SimpleToken(id=token, text=inputs[start:stop], start=start, stop=stop)
        for token, (start, stop) in zip(found.token_ids, found.spans, strict=False)], error_shape)
