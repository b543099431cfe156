"""tokenbus's job and vLLM's types in each other's terms: a job's sampling parameters and output constraint as
vLLM's, vLLM's logprobs as the bus's, and vLLM's scheduler figures as the worker's engine gauges. vllm is imported
inside each function: importing this module costs nothing."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import orjson

from shared.protocol import bus
from shared.protocol.errors import InvalidRequest
from shared.runtime import metrics


@functools.cache
def refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises when it refuses a request, the caller's error (a 400) rather than the engine failing: its
    parameter and grammar checks raise `ValueError` up to vLLM 0.25 and `VLLMClientError`s, no longer ValueErrors,
    since (0.32: an uncompilable grammar or a parameter SamplingParams refuses)."""
    from vllm import exceptions

    return (ValueError, getattr(exceptions, "VLLMClientError", ValueError))


def engine_prompt(token_ids: list[int], arrival_time: float, cache_salt: str = "") -> Any:
    """A tokenized prompt as AsyncLLM takes it from its own renderer: no second pass through the renderer, which a
    bare `{"prompt_token_ids": ...}` gets (and which vLLM deprecates), and an arrival stamped when the worker took
    the job up (wall clock), as `vllm serve` stamps it when it starts on the request: the engine's `vllm:` queue and
    latency figures then count the worker's preparation of the prompt, as theirs count the API server's. Prompts of
    different salts never share the engine's prompt cache (the job's `cache_salt`)."""
    from vllm.inputs.engine import tokens_input

    prompt = tokens_input(token_ids, cache_salt=cache_salt or None)
    prompt["arrival_time"] = arrival_time
    return prompt


def deliver_outputs(collector: Any, put: Callable[[Any], None]) -> None:
    """Makes AsyncLLM hand the request's outputs to `put` as its output handler makes them, instead of keeping them
    in `collector` (what `AsyncLLM.add_request` returned) for a task to wake for. The output processor hands each
    RequestOutput of the request, its abort's last one included, and an exception that fails every request, to
    its collector's `put` (read in vLLM 0.32, which both worker images run, and 0.25.1, the GPU bench's); an output
    the collector holds already goes first."""
    collector.put = put
    try:
        held = collector.get_nowait()
    except Exception as exc:  # it held a failure
        held = exc
    if held is not None:
        put(held)


def sampling_params(job: bus.Job, max_tokens: int, *, had: int = 0, one: bool = False,
                    prompt_logprobs: bool = True) -> Any:
    """vLLM's parameters; a choice that continues after `had` tokens runs alone (`one`) for what is left."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = job.params
    try:
        return SamplingParams(
            n=1 if one or p.greedy else p.n,  # greedy: one sequence, which each choice repeats (vLLM takes n=1)
            max_tokens=max_tokens - had,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else 0,
            min_p=p.min_p,
            seed=p.seed,
            stop=p.stop or None,
            stop_token_ids=p.stop_token_ids or None,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs if prompt_logprobs and p.scores_prompt else None,
            logit_bias=p.logit_bias or None,
            ignore_eos=p.ignore_eos,
            min_tokens=max(0, p.min_tokens - had),
            skip_special_tokens=p.skip_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs(p.constraint),
        )
    except refusals() as exc:  # vLLM's own parameter checks
        raise InvalidRequest(str(exc)) from None


def token_logprobs(
    token_ids: list[int], entries: list[dict[int, Any]] | None, top: int, special_ids: frozenset[int] = frozenset()
) -> list[bus.TokenLogprob]:
    """vLLM's per-position logprob dicts as bus logprobs: the chosen token and the `top` likeliest."""
    out: list[bus.TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries or (), strict=False):
        chosen = entry[token_id]
        ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top),
                        key=lambda pair: pair[1].rank)
        out.append(bus.TokenLogprob(
            token=chosen.decoded_token or "", logprob=max(chosen.logprob, -9999.0),
            top=[bus.TopLogprob(token=lp.decoded_token or "", logprob=max(lp.logprob, -9999.0), token_id=tid)
                 for tid, lp in ranked],
            special=token_id in special_ids,
        ))
    return out


def structured_outputs(constraint: bus.Constraint | None) -> Any:
    """vLLM's structured-output parameters for a constraint (None: free text)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.kind == "json":
        return StructuredOutputsParams(json=constraint.spec)
    if constraint.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if constraint.kind == "regex":
        return StructuredOutputsParams(regex=constraint.spec)
    if constraint.kind == "choice":
        return StructuredOutputsParams(choice=orjson.loads(constraint.spec))
    if constraint.kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=constraint.spec)
    raise InvalidRequest(f"Unknown structured output kind `{constraint.kind}`.")


GRAMMAR_BACKEND_REQUEST = "tokenbus-grammar-backend"


async def choose_xgrammar(llm: Any, token_id: int) -> None:
    """Makes XGrammar the engine's structured-output backend for good, before any request's constraint can choose.

    vLLM 0.32's engine core takes ONE backend, the one its first constrained request was given
    (StructuredOutputManager.grammar_init, `if self.backend is None`), while its "auto" check gives each request
    XGrammar or, for schemas with features XGrammar lacks (`multipleOf`, `uniqueItems`, ...), llguidance. So a fresh
    engine whose first constraint had `multipleOf` compiled everything with llguidance from then on: structural tags
    failed there, objects grew properties that elsewhere they did not, and one tenant's first request decided what
    every other got. With XGrammar chosen first, every worker answers a constraint alike, as an engine does whose
    first constraint was an ordinary schema (vllm serve's usual case), and the grammar gate compiles what the
    engine compiles. A one-token request under the smallest schema."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json='{"type": "object"}'))
    async for _ in llm.generate(engine_prompt([token_id], time.time()), params, GRAMMAR_BACKEND_REQUEST):
        pass


def compiled_spec(constraint: bus.Constraint) -> tuple[str, str] | None:
    """What vLLM's engine will compile with XGrammar for a constraint, as (kind, spec) for
    services.worker.grammar_compile: a JSON schema, a regex, a choice as the EBNF grammar vLLM makes of it, a
    structural tag. None: nothing it compiles per request (a JSON object).

    Every schema counts, those vLLM's check gives its llguidance fallback too (`multipleOf`, `uniqueItems`, ...):
    the engine compiles each constraint with the backend its first one chose (vLLM 0.32's StructuredOutputManager),
    XGrammar (see choose_xgrammar), which compiles most of those as well (ignoring what it does not support), as
    slowly."""
    from vllm.v1.structured_output.utils import choice_as_grammar

    if constraint.kind in ("json", "regex", "structural_tag"):
        return constraint.kind, constraint.spec
    if constraint.kind == "choice":
        return "grammar", choice_as_grammar(orjson.loads(constraint.spec))
    return None


def xgrammar_vocabulary(tokenizer: Any, vocab_size: int) -> bytes:
    """The engine's tokenizer as XGrammar sees it (serialized), built as vLLM's XGrammar backend builds it (with the
    model's vocabulary size)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return info.serialize_json().encode()


def engine_gauges(model: str) -> Any:
    """A vLLM stat logger that keeps the worker's engine gauges (running and waiting sequences, KV-cache use) and
    its prefix cache counters from the scheduler's own figures, each time the engine reports them."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    running, waiting, cache = (metrics.ENGINE_RUNNING.labels(model), metrics.ENGINE_WAITING.labels(model),
                               metrics.KV_CACHE_USAGE.labels(model))
    queries, hits = metrics.PREFIX_CACHE_QUERIES.labels(model), metrics.PREFIX_CACHE_HITS.labels(model)

    class EngineGauges(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                running.set(scheduler_stats.num_running_reqs)
                waiting.set(scheduler_stats.num_waiting_reqs)
                cache.set(scheduler_stats.kv_cache_usage)
                if (found := getattr(scheduler_stats, "prefix_cache_stats", None)) is not None:
                    queries.inc(found.queries)
                    hits.inc(found.hits)

        def log_engine_initialized(self) -> None:
            pass

    return EngineGauges
