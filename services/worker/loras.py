"""The LoRA adapters a worker's engine runs: each job's adapter as vLLM's LoRARequest, loaded before the job's
first engine request names it.

vLLM's engine core dies when a request names an adapter it cannot load (vllm 0.32: EngineDeadError), while
`add_lora` refuses one cleanly: so an adapter is always loaded through `add_lora` first, and a job whose adapter
cannot be loaded fails alone, with AdapterUnavailable. vllm is imported inside `request`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Protocol

from shared.protocol import bus
from shared.protocol.errors import AdapterUnavailable
from shared.tenancy.adapters import parse_modules

log = logging.getLogger(__name__)


class LoraSettings(Protocol):
    """The settings of a worker's adapters (Settings has them)."""

    @property
    def model(self) -> str: ...
    @property
    def enable_lora(self) -> bool: ...
    @property
    def lora(self) -> str: ...
    @property
    def max_loras(self) -> int: ...
    @property
    def max_lora_rank(self) -> int: ...


class Loras:
    """The adapters one engine knows: those it was started with (--lora) and those jobs brought since."""

    def __init__(self, model: str, enabled: bool, modules: dict[str, str]) -> None:
        self.model = model
        self.enabled = enabled
        self.modules = modules
        """The worker's own adapters (--lora): name -> path."""
        self.ids: dict[tuple[str, str], int] = {}
        """Each adapter (name, path) the engine was given, by its engine id: a path replaced by `adapters add`
        is another adapter, with another id."""
        self._next_id = itertools.count(1)
        self._loading: dict[int, asyncio.Future[None]] = {}
        self._held_ids: set[int] = set()
        """The engine ids it held when last asked (at each adapter job): what the heartbeat reports, without a
        round trip to the engine core that a busy engine would hold up."""

    @classmethod
    def of(cls, settings: LoraSettings) -> Loras:
        try:
            modules = parse_modules(settings.lora)
        except ValueError as exc:
            raise SystemExit(f"invalid setting lora: {exc}") from None
        if settings.max_loras < 1:
            raise SystemExit(f"invalid setting max_loras={settings.max_loras}: at least 1")
        return cls(settings.model, settings.enable_lora or bool(modules), modules)

    def _path(self, job: bus.Job) -> str:
        if not self.enabled:
            raise AdapterUnavailable(f"The workers of `{self.model}` serve no adapters.", param="model")
        if job.adapter_path:
            return job.adapter_path
        if job.adapter in self.modules:
            return self.modules[job.adapter]
        raise AdapterUnavailable(f"The adapter `{job.adapter}` is not one this worker was started with.",
                                 param="model")

    async def request(self, llm: Any, job: bus.Job) -> Any:
        """The job's LoRARequest, its adapter loaded (None for the base model)."""
        if not job.adapter:
            return None
        return await self._loaded(llm, job.adapter, self._path(job))

    async def _loaded(self, llm: Any, name: str, path: str) -> Any:
        from vllm.lora.request import LoRARequest

        lora_id = self.ids.setdefault((name, path), next(self._next_id))
        lora = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        await self._load(llm, lora)
        return lora

    async def _load(self, llm: Any, lora: Any) -> None:
        """Loads the adapter unless the engine holds it. Jobs that come meanwhile wait for that load and share its
        outcome; if the job loading it is cancelled, the next one loads it."""
        lora_id = lora.lora_int_id
        while (pending := self._loading.get(lora_id)) is not None:
            await asyncio.wait([pending])  # however it ends; a cancel of this job still raises here
            if not pending.cancelled():
                if (error := pending.exception()) is not None:
                    raise error
                return
        pending = self._loading[lora_id] = asyncio.get_running_loop().create_future()
        try:
            self._held_ids = set(await llm.list_loras())
            if lora_id not in self._held_ids:
                await _add(llm, lora)
                self._held_ids.add(lora_id)
        except AdapterUnavailable as error:
            pending.set_exception(error)
            pending.exception()  # retrieved: the jobs that waited for it raise it themselves
            raise
        except BaseException:
            pending.cancel()
            raise
        else:
            pending.set_result(None)
        finally:
            del self._loading[lora_id]

    def held(self) -> list[str]:
        """The names of the adapters the engine held when last asked."""
        return sorted({name for (name, _), lora_id in self.ids.items() if lora_id in self._held_ids})

    async def preload(self, llm: Any) -> None:
        """Loads the worker's own adapters at start: one that cannot be is a configuration error."""
        for name, path in self.modules.items():
            try:
                await self._loaded(llm, name, path)
            except AdapterUnavailable:
                raise SystemExit(f"--lora {name}={self.modules[name]}: the engine could not load it") from None


async def _add(llm: Any, lora: Any) -> None:
    try:
        await llm.add_lora(lora)
    except Exception as exc:  # vLLM wraps the worker's refusal in a bare Exception
        log.error("loading adapter %s from %s failed: %s", lora.lora_name, lora.lora_path, exc)
        raise AdapterUnavailable(f"The adapter `{lora.lora_name}` could not be loaded (the worker's log says why).",
                                 param="model") from None
