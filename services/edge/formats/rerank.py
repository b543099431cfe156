"""Rerank and score, as vLLM serves them: `/v1/rerank` (Jina's and vLLM's shape), `/v2/rerank` (Cohere's),
`/v3/rerank` (OpenVINO Model Server's) and `/v1/score` (vLLM's). The query and the documents (or the two sides of
each pair) go to the model's workers as one embedding job. On a cross-encoder (a `score` task worker) the job
names the pairs and the model reads each pair together, answering its score; on an embedding model a pair's score
is the cosine similarity of its two vectors, computed here once every vector came."""

from __future__ import annotations

import math
import operator
from typing import Annotated

from msgspec import UNSET, Meta, UnsetType

from services.edge.formats.base import Out, Request
from services.edge.formats.embeddings import Vectors
from shared.protocol import bus
from shared.protocol.errors import InvalidRequest

MAX_DOCUMENTS = 1000
"""Documents of one rerank, and texts of one side of a score: each is an embedding the worker computes."""
MAX_SCORED_VALUES = bus.MAX_VECTOR_VALUES
"""Vector values one request's scores read on the edge's loop (texts x the model's dimensions): about 60 ms of it;
what the worker answers one embedding job at most (the bus's bound).
1,000 documents of all-MiniLM-L6-v2 (384 dimensions) read 384,000 (~12 ms); a model of 4,096 dimensions ranks at
most 512 documents a request."""
MAX_PAIR_CHARACTERS = 8 * 1024 * 1024
"""Characters a cross-encoder's worker reads for one request, a pair's two texts each time: a long query is read
once per document."""
RANKING_TASKS = "embed|score"
"""The workers that rank: an embedding model's (cosines) or a cross-encoder's."""
NonEmpty = Annotated[str, Meta(min_length=1)]


class Document(Request):
    """A document as Cohere's and Jina's clients may send it: an object with its text."""

    text: NonEmpty


class RerankRequest(Request):
    model: str
    query: NonEmpty
    documents: Annotated[list[NonEmpty | Document], Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[int, Meta(gt=0)] | None = None
    """The best this many (all of them when absent)."""
    return_documents: bool = True
    """Each result with its document's text (vLLM's and Jina's default; Cohere's clients send false)."""
    max_tokens_per_doc: Annotated[int, Meta(gt=0)] | None = None
    user: str | None = None


class ScoreRequest(Request):
    """vLLM's score: one text against many (1:N), or pairs side by side (N:N)."""

    model: str
    text_1: NonEmpty | Annotated[list[NonEmpty], Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    text_2: NonEmpty | Annotated[list[NonEmpty], Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    user: str | None = None


def _texts(documents: list[str | Document]) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in documents]


def rerank_pairs(req: RerankRequest) -> tuple[list[str], list[tuple[int, int]]]:
    """The texts (the query first) and the pairs to score: the query with each document."""
    if req.max_tokens_per_doc is not None:
        raise InvalidRequest("`max_tokens_per_doc` is not supported: documents are read whole (the model's context "
                             "bounds each).", param="max_tokens_per_doc", code="unsupported_parameter")
    documents = _texts(req.documents)
    return [req.query, *documents], [(0, 1 + i) for i in range(len(documents))]


def pairs_of(req: ScoreRequest) -> tuple[list[str], list[tuple[int, int]]]:
    """The texts to embed and each pair's two indexes among them: text_1 against each of text_2 when text_1 is one
    text, else the i-th of each side (both lists of one length)."""
    left = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    right = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if len(left) == 1:
        return [*left, *right], [(0, 1 + i) for i in range(len(right))]
    if len(left) != len(right):
        raise InvalidRequest(f"`text_1` has {len(left)} texts and `text_2` {len(right)}: give one text_1, or as many "
                             "as text_2 (scored pair by pair).", param="text_2")
    return [*left, *right], [(i, len(left) + i) for i in range(len(left))]


def check_size(texts: list[str], pairs: list[tuple[int, int]], info: bus.WorkerInfo) -> None:
    """Refuses a request that would read more than MAX_SCORED_VALUES vector values on the edge's loop (cosines), or
    make a cross-encoder read more than MAX_PAIR_CHARACTERS."""
    if info.task == "score":
        if sum(len(texts[a]) + len(texts[b]) for a, b in pairs) > MAX_PAIR_CHARACTERS:
            raise InvalidRequest(f"The pairs to score hold more than {MAX_PAIR_CHARACTERS} characters (a query counts "
                                 "once per document); send fewer or shorter texts.", param="documents")
        return
    dimensions = max(info.dimensions, 1)
    if len(texts) * dimensions > MAX_SCORED_VALUES:
        raise InvalidRequest(f"{len(texts)} texts of {info.dimensions} dimensions are more than one request may score "
                             f"here; send at most {MAX_SCORED_VALUES // dimensions} in all.", param="documents")


def scoring_job(model: str, texts: list[str], pairs: list[tuple[int, int]], info: bus.WorkerInfo, *, job_id: str,
                reply_to: str, deadline_ms: int) -> bus.Job:
    """One embedding job of the texts; on a cross-encoder, with the pairs its worker scores."""
    cross = info.task == "score"
    return bus.Job(id=job_id, model=model, reply_to=reply_to, deadline_ms=deadline_ms, kind="embedding",
                   prompts=texts, pairs=pairs if cross else [], created_ms=bus.now_ms(), packed_vectors=not cross)


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0 for a zero or missing one); the products in C (map), about 12 ns a
    value."""
    if not a or len(a) != len(b):
        return 0.0
    norms = math.sqrt(sum(map(operator.mul, a, a)) * sum(map(operator.mul, b, b)))
    return sum(map(operator.mul, a, b)) / norms if norms else 0.0


# response


class DocumentOut(Out):
    text: str


class RerankResult(Out, kw_only=True):
    index: int
    relevance_score: float
    document: DocumentOut | UnsetType = UNSET


class RerankUsage(Out):
    total_tokens: int


class RerankResponse(Out, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreData(Out, kw_only=True):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(Out):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(Out, kw_only=True):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class PairScores(Vectors):
    """The score of each pair: a cross-encoder's (the vector of the pair's index), or the cosine of its texts'."""

    def __init__(self, pairs: list[tuple[int, int]], cross: bool) -> None:
        super().__init__()
        self.pairs = pairs
        self.cross = cross

    def scores(self) -> list[float]:
        if self.cross:
            return [(self.vector(n) or [0.0])[0] for n in range(len(self.pairs))]
        vectors = {i: self.vector(i) for i in self.vectors}  # each text's once, however many pairs it is in
        return [cosine(vectors.get(a, []), vectors.get(b, [])) for a, b in self.pairs]


class RerankRenderer(PairScores):
    def __init__(self, req: RerankRequest, response_id: str, cross: bool = False) -> None:
        super().__init__(rerank_pairs(req)[1], cross)
        self.id = response_id
        self.model = req.model
        self.documents = _texts(req.documents)
        self.top_n = req.top_n
        self.return_documents = req.return_documents

    def body(self) -> RerankResponse:
        scored = sorted(((score, i) for i, score in enumerate(self.scores())), key=lambda pair: (-pair[0], pair[1]))
        results = [RerankResult(index=i, relevance_score=score,
                                document=DocumentOut(self.documents[i]) if self.return_documents else UNSET)
                   for score, i in scored[:self.top_n]]
        return RerankResponse(id=self.id, model=self.model, usage=RerankUsage(self.prompt_tokens), results=results)


class ScoreRenderer(PairScores):
    def __init__(self, req: ScoreRequest, response_id: str, created: int, cross: bool = False) -> None:
        super().__init__(pairs_of(req)[1], cross)
        self.id = response_id
        self.created = created
        self.model = req.model

    def body(self) -> ScoreResponse:
        data = [ScoreData(index=n, score=score) for n, score in enumerate(self.scores())]
        return ScoreResponse(id=self.id, created=self.created, model=self.model, data=data,
                             usage=ScoreUsage(self.prompt_tokens, self.prompt_tokens))
