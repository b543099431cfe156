"""OpenAI embeddings (also served as OVMS /v3 and Databricks invocations): input, vectors, base64."""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from msgspec import UNSET, Meta, UnsetType

from services.edge.formats.base import Out, Payload, Request, Unstored, openai_error_body
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest, TokenbusError

NonEmpty = Annotated[str, Meta(min_length=1)]
MAX_INSTRUCTION_CHARS = 4096
"""An instruction is a sentence or two ("Represent this sentence for searching relevant passages: ")."""


class EmbeddingRequest(Request):
    model: str
    input: NonEmpty | Annotated[list[NonEmpty], Meta(min_length=1, max_length=2048)]
    instruction: Annotated[str, Meta(max_length=MAX_INSTRUCTION_CHARS)] | None = None
    """Prepended to every input, as instruction-tuned embedding models expect (Databricks)."""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(gt=0, le=2**31 - 1)] | None = None
    user: str | None = None


def inputs_of(req: EmbeddingRequest) -> list[str]:
    """The texts to embed, without the instruction: the worker puts it before each (a copy per input here would
    multiply the request in the edge's memory before it is charged)."""
    return [req.input] if isinstance(req.input, str) else req.input


def check_dimensions(req: EmbeddingRequest, native: int) -> None:
    if req.dimensions is not None and req.dimensions != native:
        raise InvalidRequest(
            f"The model `{req.model}` returns {native} dimensions and cannot shorten them to {req.dimensions}.",
            param="dimensions",
        )


def check_size(req: EmbeddingRequest, native: int) -> None:
    """Refuses a request whose vectors would hold more than bus.MAX_VECTOR_VALUES values (its inputs x the model's
    dimensions), whichever its encoding_format (base64 answers are smaller, but the bus and the worker carry the
    same values); `dimensions` may only name the model's own (check_dimensions), so the model's count."""
    count = len(inputs_of(req))
    if count * native > bus.MAX_VECTOR_VALUES:
        raise InvalidRequest(f"{count} inputs of {native} dimensions are more than one request may embed here; "
                             f"send at most {bus.MAX_VECTOR_VALUES // native} inputs a request.", param="input")


def to_job(req: EmbeddingRequest, *, job_id: str, reply_to: str, deadline_ms: int) -> bus.Job:
    return bus.Job(id=job_id, model=req.model, reply_to=reply_to, deadline_ms=deadline_ms, kind="embedding",
                   prompts=inputs_of(req), instruction=req.instruction or "", created_ms=bus.now_ms(),
                   packed_vectors=True)


class EmbeddingData(Out, kw_only=True):
    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Out, kw_only=True):
    id: str | UnsetType = UNSET
    """Databricks' response has one; OpenAI's schema allows it."""
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def as_base64(vector: list[float] | bytes) -> str:
    """OpenAI's base64 form: the float32 values, little-endian (as packed vectors come)."""
    return base64.b64encode(vector if isinstance(vector, bytes) else bus.pack_vector(vector)).decode()


def as_floats(vector: list[float] | bytes) -> list[float]:
    return bus.unpack_vector(vector).tolist() if isinstance(vector, bytes) else vector


class Vectors(Unstored):
    """Gathers one vector per input, and the prompt tokens; an embedding job's answer never streams. A packed
    vector is kept as its float32 bytes (4 bytes a value, not a list's 32) until the answer is made."""

    def __init__(self) -> None:
        self.vectors: dict[int, list[float] | bytes] = {}
        self.prompt_tokens = 0

    def vector(self, index: int) -> list[float]:
        """Input `index`'s vector ([] if none came)."""
        return as_floats(self.vectors.get(index, []))

    def render(self, event: bus.Output) -> list[Payload]:
        if isinstance(event, bus.Embedding):
            self.vectors[event.index] = event.packed or event.vector
        elif isinstance(event, bus.Final):
            self.prompt_tokens = event.prompt_tokens
        return []

    def done(self) -> list[Payload]:
        return []

    def error(self, error: TokenbusError) -> list[Payload]:
        return [openai_error_body(error)]


class EmbeddingRenderer(Vectors):
    def __init__(self, req: EmbeddingRequest, response_id: str = "") -> None:
        super().__init__()
        self.id = response_id
        self.model = req.model
        self.base64 = req.encoding_format == "base64"

    def body(self) -> EmbeddingList:
        data = [EmbeddingData(index=i, embedding=as_base64(v) if self.base64 else as_floats(v))
                for i, v in sorted(self.vectors.items())]
        usage = EmbeddingUsage(prompt_tokens=self.prompt_tokens, total_tokens=self.prompt_tokens)
        return EmbeddingList(id=self.id or UNSET, data=data, model=self.model, usage=usage)
