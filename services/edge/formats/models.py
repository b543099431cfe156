"""`GET /v1/models`: OpenAI's model list, with vLLM's `root` and `parent` (a LoRA adapter names its base model)."""

from __future__ import annotations

from typing import Literal

import msgspec


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tokenbus"
    """For an adapter of a tenant: that tenant (the only one it is listed to)."""
    root: str
    parent: str | None = None
    """The base model of a LoRA adapter; null for a model."""
    task: str = "generate"
    """generate or embed."""
    max_model_len: int = 0


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]
