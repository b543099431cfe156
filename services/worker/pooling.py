"""Pooling jobs on a vLLM engine: an embedding model's vector per input, and a cross-encoder's score per pair (its
two texts read together). vllm is imported inside each function."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from services.worker.streams import interleaved
from services.worker.vllm_terms import engine_prompt
from shared.protocol import bus
from shared.protocol.errors import ContextLengthExceeded, InvalidRequest


class PoolingEngine(Protocol):
    """What pooling needs of the engine (services.worker.engine.VllmEngine)."""

    llm: Any
    tokenizer: Any
    max_model_len: int
    dimensions: int
    requests: dict[str, list[str]]
    """Engine request ids of each running job (one per input or pair)."""

    async def prompt_ids(self, job: bus.Job) -> list[list[int]]: ...


async def embed(engine: PoolingEngine, job: bus.Job, priority: int) -> AsyncIterator[bus.Output]:
    """One vector per input, in input order; inputs longer than the context are an error (or cut)."""
    if len(job.prompts) * engine.dimensions > bus.MAX_VECTOR_VALUES:  # from an edge of an earlier version
        raise InvalidRequest(f"{len(job.prompts)} inputs of {engine.dimensions} dimensions are more than one "
                             f"request may embed; send at most {bus.MAX_VECTOR_VALUES // engine.dimensions} "
                             "inputs a request.", param="input")
    from vllm import PoolingParams

    arrival = time.time()
    prompts = await engine.prompt_ids(job)
    for i, ids in enumerate(prompts):
        if len(ids) > engine.max_model_len:
            if not job.truncate:
                raise ContextLengthExceeded(
                    f"Input {i} has {len(ids)} tokens; this model embeds at most {engine.max_model_len}.",
                    param="input",
                )
            prompts[i] = ids[: engine.max_model_len]
    async for event in _pooled(engine, job, [(ids, PoolingParams(task="embed")) for ids in prompts], priority,
                               arrival):
        yield event


async def score(engine: PoolingEngine, job: bus.Job, priority: int) -> AsyncIterator[bus.Output]:
    """A cross-encoder's score of each pair, read together (its texts as the tokenizer pairs them, with their
    token types), in pair order; a pair longer than the context is an error."""
    from vllm import PoolingParams

    if not job.pairs:
        raise InvalidRequest("This model is a cross-encoder: it scores pairs (rerank, score), it does not embed.",
                             param="model", code="wrong_model_task")
    arrival = time.time()
    encoded = await asyncio.to_thread(pair_encodings, engine.tokenizer, engine.max_model_len, job)
    requests = [(ids, PoolingParams(task="classify", extra_kwargs={"compressed_token_type_ids": second}))
                for ids, second in encoded]
    async for event in _pooled(engine, job, requests, priority, arrival):
        yield event


def pair_encodings(tokenizer: Any, max_model_len: int, job: bus.Job) -> list[tuple[list[int], int]]:
    """Each pair's token ids, and where its second text starts (its first token of type 1), as vLLM takes a
    cross-encoder's token types."""
    firsts, seconds = zip(*((job.prompts[a], job.prompts[b]) for a, b in job.pairs), strict=True)
    batch = tokenizer(text=list(firsts), text_pair=list(seconds))
    encoded: list[tuple[list[int], int]] = []
    for i, ids in enumerate(batch["input_ids"]):
        if len(ids) > max_model_len:
            raise ContextLengthExceeded(f"Pair {i} has {len(ids)} tokens; this model reads at most {max_model_len}.",
                                        param="documents")
        types = batch.get("token_type_ids", [[]] * len(job.pairs))[i]
        encoded.append((list(ids), types.index(1) if 1 in types else len(ids)))
    return encoded


async def _pooled(engine: PoolingEngine, job: bus.Job, requests: list[tuple[list[int], Any]],
                  priority: int, arrival: float) -> AsyncIterator[bus.Output]:
    """One engine request per input (or pair), an Embedding event for each as it finishes, then the Final; the
    inputs a former owner already sent (a job taken over) are not run again."""
    done = set(job.continuation.embedded) if job.continuation else set()
    request_ids = [f"{job.id}-{i}" for i in range(len(requests))]
    engine.requests[job.id] = request_ids
    try:
        streams = [_one(engine, job, rid, i, ids, params, priority, arrival)
                   for i, (rid, (ids, params)) in enumerate(zip(request_ids, requests, strict=True)) if i not in done]
        async for event in interleaved(streams):
            yield event
    finally:
        del engine.requests[job.id]
    yield bus.Final(job=job.id, prompt_tokens=sum(len(ids) for ids, _ in requests), completion_tokens=0)


async def _one(engine: PoolingEngine, job: bus.Job, request_id: str, index: int, ids: list[int], params: Any,
               priority: int, arrival: float) -> AsyncIterator[bus.Output]:
    prompt = engine_prompt(ids, arrival, job.cache_salt)
    async for out in engine.llm.encode(prompt, params, request_id, priority=priority):
        if out.finished:
            if job.packed_vectors:
                yield bus.Embedding(job=job.id, index=index, packed=packed(out.outputs.data), prompt_tokens=len(ids))
            else:
                yield bus.Embedding(job=job.id, index=index, vector=out.outputs.data.tolist(), prompt_tokens=len(ids))


def packed(data: Any) -> bytes:
    """A pooled output (a torch tensor) as bus.Embedding.packed carries it: float32, little-endian (the precision
    of OpenAI's own base64 answers; the engine's vectors are float32 or narrower)."""
    if sys.byteorder == "little":
        return data.detach().float().cpu().numpy().tobytes()
    return bus.pack_vector(data.tolist())
