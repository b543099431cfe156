"""OpenAI Completions: prompts (a batch), n, echo, suffix, logprobs, Databricks' extras."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, UnsetType

from services.edge.formats import structured
from services.edge.formats.base import (
    Choices,
    OpenAIStreamEnd,
    Out,
    Payload,
    Usage,
    finish_reason,
    refuse,
    refuse_beyond_context,
    usage_of,
)
from services.edge.formats.common import (
    INT32_MAX,
    PositiveInt,
    Sampling,
    sampling_params,
)
from shared.protocol import bus
from shared.protocol.errors import ContextLengthExceeded, InvalidRequest

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""

NonEmpty = Annotated[str, Meta(min_length=1)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]
MAX_COPIED_CHARS = 1 << 20
MAX_PROMPTS = 256
"""Prompts one request may batch."""


class CompletionRequest(Sampling, kw_only=True):
    model: str
    prompt: NonEmpty | Annotated[list[NonEmpty | TokenId | TokenIds], Meta(min_length=1)]
    """A string, a batch of strings, one prompt's token ids, or a batch of token-id prompts (see split_prompt;
    the body's size bounds how many ids)."""
    max_tokens: PositiveInt | None = DEFAULT_MAX_TOKENS
    best_of: Annotated[int, Meta(ge=1)] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    """Appended to the end of each completion (Databricks' meaning)."""
    use_raw_prompt: bool | None = None
    """False: wrap each prompt in the model's chat template; True or absent: the prompt as it is."""
    error_behavior: Literal["error", "truncate"] = "error"


def split_prompt(req: CompletionRequest) -> tuple[list[str], list[list[int]]]:
    """The prompts as texts, or (given as token ids, as OpenAI and vLLM take them) an empty text for each and their
    ids; a mix of the forms is refused, as is a batch of more than MAX_PROMPTS."""
    given = req.prompt
    if isinstance(given, str):
        return [given], []
    if all(isinstance(each, int) for each in given):
        return [""], [list(given)]  # type: ignore[arg-type]
    if len(given) > MAX_PROMPTS:
        raise InvalidRequest(f"At most {MAX_PROMPTS} prompts are served in one request.", param="prompt")
    if all(isinstance(each, str) for each in given):
        return list(given), []  # type: ignore[arg-type]
    if all(isinstance(each, list) for each in given):
        return [""] * len(given), list(given)  # type: ignore[arg-type]
    raise InvalidRequest("`prompt` is a string, a list of strings, a list of token ids, or a list of lists of token "
                         "ids; not a mix of them.", param="prompt")


def prompts_of(req: CompletionRequest) -> list[str]:
    return split_prompt(req)[0]


def check_context(req: CompletionRequest, max_model_len: int) -> None:
    """max_tokens must leave room for the prompt, unless Databricks' truncate asks for what fits instead; a prompt
    of token ids is counted exactly, here, as vLLM does."""
    if req.error_behavior == "truncate":
        return
    refuse_beyond_context(req.max_tokens, max_model_len, "max_tokens")
    longest = max(map(len, split_prompt(req)[1]), default=0)
    if max_model_len and longest + (req.max_tokens or 0) > max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest + (req.max_tokens or 0)} tokens ({longest} in the prompt, {req.max_tokens or 0} in the "
            "completion). Please reduce the length of the prompt or completion.", param="prompt")


def check_copies(req: CompletionRequest) -> None:
    """The text the answer repeats (the suffix on every choice, each prompt echoed on each of its n choices) is
    bounded: it is held in the edge's memory once per copy, and it costs the tenant no tokens."""
    prompts = prompts_of(req)
    suffixes = len(req.suffix or "") * req.n * len(prompts)
    echoes = sum(map(len, prompts)) * req.n if req.echo else 0
    if suffixes + echoes > MAX_COPIED_CHARS:
        param = "suffix" if suffixes >= echoes else "echo"
        raise InvalidRequest(f"The answer would repeat {suffixes + echoes} characters of the request (`suffix` on "
                             f"each choice, and with `echo` each prompt on each of its `n` choices); at most "
                             f"{MAX_COPIED_CHARS} are served.", param=param)


def to_job(req: CompletionRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    if req.best_of is not None and req.best_of != req.n:
        raise refuse("best_of", "only best_of equal to n is served")
    check_copies(req)
    prompts, ids = split_prompt(req)
    if ids and req.use_raw_prompt is False:
        raise InvalidRequest("A prompt of token ids runs as given: it cannot be wrapped in the chat template.",
                             param="use_raw_prompt")
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    if ids and req.echo and prompt_logprobs is None:
        prompt_logprobs = 0  # the worker's Prompt event brings the text to echo: the edge has only the ids
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    params.constraint = structured.of_structured_outputs(req.structured_outputs)
    return bus.Job(
        id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="completion",
        prompts=prompts, prompt_ids=ids, chat_template=req.use_raw_prompt is False,
        truncate=req.error_behavior == "truncate", params=params, created_ms=bus.now_ms(),
        cache_key=req.prompt_cache_key or "",
    )


# response


class CompletionLogprobs(Out, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Out, kw_only=True):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(Out, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType = UNSET


class LogprobsBuilder:
    """Completions logprobs of one choice, with text offsets that continue across chunks."""

    def __init__(self) -> None:
        self.offset = 0

    def build(self, logprobs: list[bus.TokenLogprob], echo: bus.Prompt | None = None) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if echo is not None:
            self._add(out, echo.first_token, None, None)
            for lp in echo.logprobs:
                self._add(out, lp.token, lp.logprob, {t.token: t.logprob for t in lp.top})
        for lp in logprobs:
            self._add(out, lp.token, lp.logprob, {t.token: t.logprob for t in lp.top})
        return out

    def _add(self, out: CompletionLogprobs, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(self.offset)
        self.offset += len(token)


class CompletionRenderer(OpenAIStreamEnd):
    """Completions as a state machine: text chunks per choice (echo first, suffix last), then usage."""

    def __init__(self, req: CompletionRequest, *, response_id: str, created: int) -> None:
        self.id = response_id
        self.created = created
        self.model = req.model
        self.prompts = prompts_of(req)
        self.n = req.n
        self.echo = req.echo
        self.suffix = req.suffix or ""
        self.with_logprobs = req.logprobs is not None
        self.include_usage = req.include_usage
        count = len(self.prompts) * req.n
        self.choices = Choices(count)
        self.echoes: dict[int, bus.Prompt] = {}
        self.started = [False] * count
        self.builders = [LogprobsBuilder() for _ in range(count)]
        self.logprobs: dict[int, CompletionLogprobs] = {}

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | UnsetType = UNSET) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _piece(self, event: bus.Tokens) -> CompletionChoice:
        """The choice's new text and logprobs: the echoed prompt before its first tokens, the suffix after its last."""
        i = event.choice
        head, echo = "", None
        if not self.started[i]:
            self.started[i] = True
            if self.echo:
                head, echo = self.prompts[i // self.n], self.echoes.get(i // self.n)
                head = head or (echo.text if echo is not None else "")  # token ids: the worker sent the text
        tail = self.suffix if event.finish_reason is not None else ""
        logprobs = self.builders[i].build(event.logprobs or [], echo) if self.with_logprobs else None
        return CompletionChoice(text=head + event.text + tail, index=i, logprobs=logprobs,
                                finish_reason=finish_reason(event.finish_reason))

    def render(self, event: bus.Output) -> list[Payload]:
        if isinstance(event, bus.Prompt):
            self.echoes[event.index] = event
            return []
        if isinstance(event, bus.Final):
            self.choices.final = event
            return [self._chunk([], usage_of(event))] if self.include_usage else []
        if not isinstance(event, bus.Tokens):
            return []
        piece = self._piece(event)
        self.choices.add(bus.Tokens(job=event.job, text=piece.text, token_ids=[], choice=event.choice,
                                    finish_reason=event.finish_reason))
        if piece.logprobs is not None:
            self._gather(piece.index, piece.logprobs)
        return [self._chunk([piece])]

    def _gather(self, index: int, piece: CompletionLogprobs) -> None:
        whole = self.logprobs.setdefault(index, CompletionLogprobs(
            tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[]))
        whole.tokens += piece.tokens
        whole.token_logprobs += piece.token_logprobs
        whole.top_logprobs += piece.top_logprobs
        whole.text_offset += piece.text_offset

    def body(self) -> Completion:
        choices = [
            CompletionChoice(text=self.choices.text(i), index=i, logprobs=self.logprobs.get(i),
                             finish_reason=finish_reason(reason))
            for i, reason in enumerate(self.choices.finish_reasons)
        ]
        final = self.choices.final or bus.Final(job=self.id, prompt_tokens=0, completion_tokens=0)
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage_of(final))
