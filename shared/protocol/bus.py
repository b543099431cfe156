"""The internal job and event formats that cross Redis, independent of the public API formats.

A job is what an edge asks a worker to do; events are what the worker sends back: `Started` (who owns
the job now), `Tokens` deltas per choice, then exactly one `Final` or `Error`. Both are msgpack-encoded
msgspec structs; new fields always get defaults so edges and workers of neighbouring versions understand
each other.

Every event has a position (`seq`) in its job's sequence and the `epoch` of the owner that wrote it: a job
that moves to another worker continues at the next position under a higher epoch, so a reader keeps each
position once and drops what a former owner writes late (see shared.protocol.sequence).
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Iterable
from typing import Any

import msgspec

GREEDY_BELOW = 1e-5
"""A temperature below this is greedy sampling (vLLM's _SAMPLING_EPS)."""
MAX_TOKEN_CHARS = 256
"""The most characters one token of today's tokenizers spells (their longest, runs of spaces or of one symbol,
stay well under it: SmolLM2's is 81): a text longer than this many per token of a context cannot fit it."""


class Base(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Internal structs: compact on the wire (defaults omitted), tolerant of fields added later."""


class Message(Base):
    """One chat message with its content flattened to text; an assistant's may carry the calls it made, a
    `tool` message answers one of them."""

    role: str
    content: str
    tool_calls: list[ToolCall] = []
    tool_call_id: str = ""
    """Role tool: the call this message is the result of."""
    reasoning: str = ""
    """Role assistant: the reasoning that came before its answer, for templates that show it again."""


class ToolCall(Base):
    """A function call an assistant made: its id, the function's name, the arguments as JSON text."""

    id: str
    name: str
    arguments: str = "{}"


class Tool(Base):
    """A function the model may call: its `parameters` are a JSON schema ({} for none)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}
    strict: bool = False


class ToolUse(Base):
    """The functions a chat job offers and how the model may call them.

    `choice` is auto (the worker's tool parser finds calls in the model's own text), required (one call or
    more, forced by a constraint: the answer is a JSON array of {"name", "arguments"}), function (a call of
    `name`, forced: the answer is its arguments) or none (no calls: the template is not given the tools)."""

    tools: list[Tool]
    choice: str = "auto"
    name: str = ""
    """choice function: the function to call."""
    parallel: bool = True
    """More than one call per answer allowed (required: false means exactly one)."""


class SamplingParams(Base):
    """Engine-neutral sampling settings; the worker translates them to its engine's parameters."""

    max_tokens: int | None = None
    """None: as many as the context leaves."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: no top-k filtering."""
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """Top alternatives per sampled token; None: no logprobs at all."""
    prompt_logprobs: int | None = None
    """Top alternatives per prompt token (for echo with logprobs); None: none. Set with `logprobs` None, it asks only
    for the prompt back (the echo of a prompt of token ids): see scores_prompt."""
    logit_bias: dict[int, float] = {}
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None
    """Structured output the engine must guarantee (a JSON schema, any JSON object, a regex)."""

    @property
    def greedy(self) -> bool:
        """The likeliest token each time: every choice of a prompt is the same answer."""
        return self.temperature < GREEDY_BELOW

    @property
    def scores_prompt(self) -> bool:
        """Whether the engine is to score the prompt's tokens (their logprobs: an echo with logprobs, TGI's
        decoder_input_details), not only hand the prompt back."""
        return self.prompt_logprobs is not None and self.logprobs is not None


class Constraint(Base):
    """What every token of the answer must keep possible: `kind` json (a JSON schema, `spec` its JSON
    text), json_object (any JSON object), regex (`spec` the expression), choice (`spec` a JSON list of the
    strings), structural_tag (`spec` XGrammar's structural tag as JSON)."""

    kind: str
    spec: str = ""


class Job(Base):
    """One request, normalized: the prompt as chat messages or text, the sampling, the deadline."""

    id: str
    model: str
    reply_to: str
    """Events stream of the edge that waits for this job."""
    deadline_ms: int
    """Unix time in ms after which the job is worthless: a worker drops it, or ends it with an error."""
    kind: str = "chat"
    """chat: `messages` through the chat template | completion: each of `prompts` as it is |
    embedding: one vector for each of `prompts`"""
    messages: list[Message] = []
    prompts: list[str] = []
    """A batch: prompt i yields choices i*n .. i*n+n-1."""
    prompt_ids: list[list[int]] = []
    """Completion jobs whose prompts came as token ids (OpenAI's and vLLM's): run as given, each in place of the
    empty string `prompts` holds for it."""
    instruction: str = ""
    """Embedding jobs: text the worker puts before every prompt (once here, however many prompts there are)."""
    chat_template: bool = False
    """Completion jobs: wrap each prompt in the chat template as one user message."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = {}
    """Extra variables for the model's chat template (e.g. enable_thinking, reasoning_effort)."""
    tool_use: ToolUse | None = None
    """Chat jobs: the functions the model may call (None: none offered)."""
    truncate: bool = False
    """Drop the oldest prompt tokens that do not fit the context instead of failing."""
    keep_last_tokens: int = 0
    """TGI's `truncate`: keep only the last n prompt tokens (0: all)."""
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    created_ms: int = 0
    request_id: str = ""
    """The edge's request id (x-request-id), for the worker's logs."""
    tenant: str = ""
    """Who asked (the API key's tenant; "" when the edge serves without keys)."""
    weight: float = 1.0
    """The tenant's share of the model's workers relative to other tenants (fair share)."""
    priority: int = 0
    """Strict priority band: backlogged jobs of a higher band always go first."""
    prompt_estimate: int = 0
    """Prompt tokens as the edge estimates them (it has no tokenizer): for admission and fair share."""
    output_budget: int = 0
    """Completion tokens the job may generate, all choices together: what admission reserves."""
    charge: Charge | None = None
    """The rate-limit reservation to settle with the real usage when the job ends (None: no limits)."""
    replayable: bool = False
    """Its client may resume the stream (it asked for event ids): the worker charges the job's event log to its
    tenant's storage when the job ends (shared.tenancy.storage)."""
    background: bool = False
    """A background response: it runs on whether or not anyone reads its events (never abandoned; only a cancel
    or its deadline stops it), and its log is kept `log_ttl_ms` after its end for any edge to render it from."""
    log_ttl_ms: int = 0
    """How long its event log is kept after its end; 0: the worker's --replay-ttl-s."""
    handovers: int = 0
    """How many times a draining worker handed this job on (0: as the edge enqueued it). A job with
    handovers, or one reclaimed from a dead worker, continues from its event log."""
    continuation: Continuation | None = None
    """Set by the worker that takes the job over: what the client already has, for the engine to continue."""
    cache_salt: str = ""
    """Jobs share the engine's prompt cache (and dispatch's prefix chains) only with jobs of the same salt: the
    edge sets the tenant here (--prompt-cache tenant), so one tenant cannot time another's prompts; "" shares."""
    cache_key: str = ""
    """The client's prompt_cache_key: jobs of a tenant with the same one share the head of their prefix chain
    (shared.protocol.prefixes), so dispatch sends them where one ran."""
    count_only: bool = False
    """Render and count the prompt, run nothing: the worker answers with a Final of its prompt tokens alone
    (Anthropic's count_tokens)."""
    tokens_out: bool = False
    """A count_only job whose prompt's tokens are the answer (/tokenize, /detokenize): a Prompt event of its first
    prompt (ids, each token's string, each one's character span in a plain prompt, the text of a prompt given as
    ids) comes before the Final."""
    add_special_tokens: bool = True
    """Completion jobs: the tokenizer's special tokens (a BOS) around each text prompt, as vLLM adds them."""
    pairs: list[tuple[int, int]] = []
    """An embedding job for a cross-encoder (a score task): the pairs of `prompts`, by index, that the model reads
    together, one score each (an Embedding event per pair, its vector the one score)."""
    adapter: str = ""
    """The LoRA adapter of `model` the job runs with ("" for the base model): the name the client asked for."""
    adapter_path: str = ""
    """Where the worker loads that adapter from (shared.tenancy.adapters' registry); "" for one the worker was
    started with (--lora)."""
    packed_vectors: bool = False
    """Embedding jobs of an embedding model: the edge reads each vector as float32 bytes (Embedding.packed), half
    the bus and the job's log that float64 lists take. A worker of an earlier version ignores it and sends
    `vector` lists, which the edge reads as well; an edge of an earlier version never sets it."""

    def log_kept_ms(self, default_ms: int) -> int:
        """How long its event log is kept after its end, where the worker keeps logs `default_ms`."""
        return self.log_ttl_ms or default_ms

    def sequences(self) -> int:
        """The engine sequences the job runs at once, each taking one of a worker's slots: one per input of an
        embedding job (per pair of a cross-encoder's), else `n` per prompt (a chat has one)."""
        if self.kind == "embedding":
            return max(1, len(self.pairs) or len(self.prompts))
        return max(1, len(self.prompts)) * max(1, self.params.n)


class Charge(Base):
    """Tokens reserved at admission for one API key, settled by the worker that ends the job: the unused
    part goes back to the key's tokens-per-minute allowance and its quota, the real usage is accounted."""

    key: str
    """The key's id (a prefix of its hash; never the key)."""
    tokens: int
    """Reserved: the prompt estimate plus the output budget."""
    tpm: int = 0
    """The key's tokens-per-minute limit when the job was admitted (0: none)."""
    quota_window: str = ""
    """The quota period the tokens were charged to ("" for no quota), e.g. 2026-11 or 2026-11-23."""
    lease: str = ""
    """The concurrency lease the job holds ("" for none): whoever settles the job gives it back, so a job kept
    running for a resume holds it until it really ends."""
    lane: str = ""
    """Where its usage is counted apart ("batch": a line of a batch), "" for interactive work."""


class Continuation(Base):
    """What a former owner already generated for a job, read from its event log: the new owner continues
    each unfinished choice after these tokens, and the usage counts them."""

    token_ids: list[list[int]] = []
    """Per choice, the tokens generated so far."""
    finished: list[bool] = []
    """Per choice, whether it has ended."""
    prompted: list[int] = []
    """Prompts whose Prompt event (echo logprobs) was already sent."""
    embedded: list[int] = []
    """Embedding inputs whose vectors were already sent."""
    texts: list[str] = []
    """Per choice, the text sent so far (after parsing: content only)."""
    calls: list[list[ToolCall]] = []
    """Per choice, the tool calls sent so far, as far as their deltas went."""
    reasonings: list[str] = []
    """Per choice, the reasoning sent so far."""

    def carried(self) -> int:
        """Completion tokens the former owners generated."""
        return sum(map(len, self.token_ids))


class TopLogprob(Base, array_like=True):
    token: str
    logprob: float
    token_id: int = -1


class TokenLogprob(Base, array_like=True):
    """One token with its log probability and the most likely alternatives at its position."""

    token: str
    logprob: float
    top: list[TopLogprob] = []
    special: bool = False


class Stamped(Base, kw_only=True):
    """What every event carries: its job, its position in the job's sequence, its owner's epoch."""

    job: str
    seq: int = 0
    epoch: int = 0


START_NOTICE_S = 7.0
"""A worker decides to start a job no later than the queue timeout after the job's creation, and its Started event
reaches the job's edge within this long of that decision (its check for a cancel first, a write's flight and the
hosts' clocks' difference): an edge that has heard of no start by then knows that no worker will start the job."""


class Started(Stamped, tag="start", kw_only=True):
    """A worker took the job: `epoch` counts its owners so far, `seq` is where this owner begins."""

    worker: str
    resumed: bool = False
    """It continues what a former owner began (a migration)."""


class Prompt(Stamped, tag="prompt", kw_only=True):
    """The tokens of prompt `index` of a job, with their logprobs (for echo); sent before its tokens."""

    index: int
    token_ids: list[int]
    first_token: str = ""
    """The first token's text: it has no logprob, nothing comes before it."""
    logprobs: list[TokenLogprob] = []
    """Of the second token onwards."""
    text: str = ""
    """The prompt's text, for a prompt given as token ids (echo repeats it): the edge has only its ids."""
    token_strs: list[str] = []
    """tokens_out jobs: each token as the tokenizer's vocabulary spells it."""
    spans: list[tuple[int, int]] = []
    """tokens_out jobs with a plain text prompt: each token's start and end in it, in characters."""


class ToolCallDelta(Base, array_like=True):
    """Part of a tool call the worker's parser found in a choice's text: a call's first delta has its `id`
    and `name`, the following ones fragments of its `arguments` (JSON text); `index` counts the calls of
    the choice."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class Tokens(Stamped, tag="tok", kw_only=True):
    """New tokens of one choice from one engine step; the last one of a choice has finish_reason. With a
    tool parser, `text` is the content only and the calls come as `tool_calls` deltas; with a reasoning
    parser, the reasoning comes as `reasoning` (before any content of the same event)."""

    text: str
    token_ids: list[int]
    choice: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """stop | length | abort | tool_calls (it stopped after making calls)"""
    tool_calls: list[ToolCallDelta] = []
    stop_reason: str | int | None = None
    """The stop string or token that ended the choice, when one did."""
    reasoning: str = ""


MAX_VECTOR_VALUES = 2_097_152
"""Vector values one embedding job of an embedding model may answer (its inputs x the model's dimensions), the
edge's bound on a request and the worker's before it computes any: what they cost is not charged (the tokens
are the inputs'), and they are its events on the bus and in its log (8 MB as float32), its answer's JSON (about
40 MB of floats) and ~200 ms of the edge's loop to render (services.edge.formats.embeddings). 2,048 inputs (OpenAI's
bound) of a 1,024-dimension model, so that clients' usual batches of 1,000 fit models up to 2,048 dimensions."""


def pack_vector(values: Iterable[float]) -> bytes:
    """A vector as Embedding.packed carries it: float32, little-endian."""
    floats = array("f", values)
    if sys.byteorder == "big":
        floats.byteswap()
    return floats.tobytes()


def unpack_vector(packed: bytes) -> array[float]:
    """The float32 values of Embedding.packed."""
    floats = array("f")
    floats.frombytes(packed)
    if sys.byteorder == "big":
        floats.byteswap()
    return floats


class Embedding(Stamped, tag="emb", kw_only=True):
    """The vector of input `index` of an embedding job: as `packed` for a job with packed_vectors (from a worker
    that knows of them), else as `vector`."""

    index: int
    vector: list[float] = []
    prompt_tokens: int
    packed: bytes = b""
    """The vector's float32 values, little-endian (pack_vector)."""

    def values(self) -> list[float]:
        return unpack_vector(self.packed).tolist() if self.packed else self.vector


class Final(Stamped, tag="end", kw_only=True):
    """The job is finished: the last event of a successful job."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    dropped_messages: int = 0
    """Truncation "auto": how many of the oldest non-system messages the prompt left out (what a stored response
    keeps as the history that was run)."""


class Error(Stamped, tag="err", kw_only=True):
    """The job failed; `kind` names a class in shared.protocol.errors."""

    kind: str
    message: str
    param: str | None = None
    code: str | None = None


Output = Prompt | Tokens | Embedding | Final
"""What a job produces when it goes well."""
Event = Started | Prompt | Tokens | Embedding | Final | Error

class WorkerInfo(Base):
    """A worker's heartbeat: what it serves and how much; it expires when the worker stops beating."""

    worker: str
    model: str
    task: str = "generate"
    max_model_len: int = 0
    dimensions: int = 0
    slots: int = 1
    """Sequences it runs at once (its max_num_seqs): the widest job it can take."""
    running: int = 0
    """Slots its jobs hold now (their sequences)."""
    adapters: list[str] = []
    """The LoRA adapters it was started with (--lora): public adapters of its model, loaded from its own paths."""
    max_loras: int = 0
    """Adapters its engine runs at once (--max-loras); 0: it serves no adapters."""
    held: list[str] = []
    """The adapters its engine holds now (started with, or loaded for a job since)."""
    features: list[str] = []
    """What of the bus it takes that older workers ignored (WORKER_FEATURES): an edge sends a job that needs one
    only while every live worker of its model has it (the edge reads the model's common ones)."""


WORKER_FEATURES = ("prompt_ids", "tokens_out")
"""Job fields this worker acts on that a worker of an earlier version ignored: Job.prompt_ids (it would run an empty
prompt) and Job.tokens_out (it would answer a count alone)."""
PROMPT_SCORES = "prompt_scores"
"""A worker's feature when its engine scores prompts (SamplingParams.scores_prompt): not with LoRA enabled, where
vLLM's prompt logprobs fail its engine core when a step holds more than one request (vLLM issues 29955, 16668)."""


class Route(Base):
    """Sent by an edge on keys.ROUTE_CHANNEL about a running job: its client resumed on the edge that reads
    `reply_to`, or (no `reply_to`) its client left and the job may run until `keep_until_ms` for a resume."""

    job: str
    reply_to: str = ""
    keep_until_ms: int = 0


JOB_FIELD = b"j"
EVENTS_FIELD = b"e"

_job_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.msgpack.Decoder(Job)
_events_encoder = msgspec.msgpack.Encoder()
_events_decoder = msgspec.msgpack.Decoder(list[Event])


def encode_job(job: Job) -> bytes:
    return _job_encoder.encode(job)


def decode_job(data: bytes) -> Job:
    return _job_decoder.decode(data)


def encode_events(events: list[Event]) -> bytes:
    return _events_encoder.encode(events)


def decode_events(data: bytes) -> list[Event]:
    return _events_decoder.decode(data)


_info_encoder = msgspec.json.Encoder()
_info_decoder = msgspec.json.Decoder(WorkerInfo)


def encode_info(info: WorkerInfo) -> bytes:
    return _info_encoder.encode(info)


def decode_info(data: bytes) -> WorkerInfo:
    return _info_decoder.decode(data)


_route_encoder = msgspec.msgpack.Encoder()
_route_decoder = msgspec.msgpack.Decoder(Route)


def encode_route(route: Route) -> bytes:
    return _route_encoder.encode(route)


def decode_route(data: bytes) -> Route:
    return _route_decoder.decode(data)


def add_call_deltas(calls: list[ToolCall], deltas: list[ToolCallDelta]) -> None:
    """Folds tool-call deltas into the calls they build (a delta with an id opens a call)."""
    for delta in deltas:
        if delta.id:
            calls.append(ToolCall(id=delta.id, name=delta.name, arguments=""))
        if 0 <= delta.index < len(calls):
            calls[delta.index].arguments += delta.arguments


def now_ms() -> int:
    return int(time.time() * 1000)
