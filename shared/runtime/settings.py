"""One frozen settings struct, read once from flags and TOKENBUS_* environment variables."""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path
from typing import Any, Protocol

import msgspec

ENV_PREFIX = "TOKENBUS_"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
TASKS = ("generate", "embed", "score")
ENGINES = ("vllm", "sim")
AUTH_MODES = ("keys", "none")
REDIS_DOWN_POLICIES = ("closed", "open", "local")
SCHEDULERS = ("fair", "fifo")
DISPATCHES = ("aware", "blind")
PROMPT_CACHES = ("tenant", "shared")
LOG_FORMATS = ("text", "json")
EVENT_LOOPS = ("uvloop", "asyncio")


def cache_dir() -> Path:
    """Where prepared models live: $TOKENBUS_CACHE_DIR, or $XDG_CACHE_HOME/tokenbus, or ~/.cache/tokenbus."""
    if explicit := os.environ.get(ENV_PREFIX + "CACHE_DIR"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenbus"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Every setting of every tokenbus process; each field is a flag (--redis-url) and a variable
    (TOKENBUS_REDIS_URL). Durations carry their unit in the name."""

    redis_url: str = ""
    """Redis to use (`redis://host:port/db`, `unix:///path/redis.sock?db=0`); empty means `tokenbus run` starts a
    private redis-server, reached over a Unix socket."""
    redis_cluster: bool = False
    """The Redis at --redis-url is a node of a Redis Cluster: talk to the whole cluster through it."""
    redis_username: str = ""
    """Redis ACL user to log in as (empty: the URL's, or Redis's `default` user)."""
    redis_password_file: str = ""
    """File holding that user's password (a mounted secret): never put in a URL, the environment or a log."""
    redis_tls_ca_file: str = ""
    """For a `rediss://` URL (TLS): the CA certificate that signed Redis's (empty: the system's CAs)."""
    redis_tls_cert_file: str = ""
    """For a `rediss://` URL: this client's certificate, when Redis asks clients for one (`tls-auth-clients`)."""
    redis_tls_key_file: str = ""
    """The private key of --redis-tls-cert-file."""
    host: str = "127.0.0.1"
    """Address the edge's API listens on (and the metrics endpoint, unless --metrics-host)."""
    port: int = 8000
    """Port the edge listens on."""
    model: str = DEFAULT_MODEL_NAME
    """Model name a worker serves (the requests' `model`); for an edge, the model of the TGI routes."""
    model_dir: str = ""
    """Hugging Face model folder the worker loads; empty means the bundled default model of its task."""
    task: str = "generate"
    """What the worker serves: generate (chat, completions, responses, TGI), embed (embeddings; rerank and score by
    cosine similarity) or score (a cross-encoder: rerank and score, each pair read together)."""
    embedding_model: str = DEFAULT_EMBEDDING_MODEL_NAME
    """Embedding model `tokenbus run` serves next to the chat model; empty serves none."""
    embedding_model_dir: str = ""
    """Folder of that embedding model; empty means the bundled all-MiniLM-L6-v2."""
    tool_parser: str = "hermes"
    """How the worker finds function calls in its model's text (tool_choice auto): hermes (<tool_call>{json}
    </tool_call>), json (a JSON object or array of {"name", "arguments"}); a template without tools is told
    to write that format."""
    reasoning_parser: str = "none"
    """How the worker finds its model's reasoning in a chat answer: none (the model does not think), qwen3
    (a <think>...</think> block the model opens), deepseek_r1 (the chat template opens the block, the
    model closes it with </think>)."""
    enable_lora: bool = False
    """The worker serves LoRA adapters of its model (vLLM's --enable-lora): those of --lora and those added with
    `tokenbus adapters add`, loaded when a job first needs one. --lora turns it on."""
    lora: str = ""
    """Adapters the worker loads at start, `NAME=PATH` comma-separated (vLLM's --lora-modules): public adapters of
    its model, served by the workers started with them."""
    max_loras: int = 4
    """Adapters the worker's engine runs in one batch, and holds loaded (vLLM's --max-loras): a job for another
    waits for one to finish."""
    max_lora_rank: int = 16
    """Largest adapter rank the worker loads (vLLM's --max-lora-rank: 1, 8, 16, 32, 64, ...)."""
    engine: str = "vllm"
    """vllm, or sim: a simulated engine with fixed timings, only for benchmarks and fault tests."""
    sim_ttft_ms: float = 50.0
    """The simulated engine's time to first token."""
    sim_itl_ms: float = 20.0
    """The simulated engine's time between tokens (one step of its batch)."""
    sim_prefill_us_per_token: float = 0.0
    """The simulated engine's prefill cost per prompt token (a word), spent in one lane that all prefills share, in
    chunks, the most urgent first (as an engine's token budget per step); its time to first token adds it to
    `sim_ttft_ms`. 0: prefills cost only `sim_ttft_ms`, each on its own."""
    sim_dies_after_tokens: int = 0
    """The simulated engine dies (as vLLM's engine core does, EngineDeadError) once it has made this many tokens in
    all: the requests it runs and every later one fail. 0: never. A fault-testing tool."""
    sim_prefix_cache_blocks: int = 0
    """The simulated engine's prefix cache, in blocks of 16 prompt tokens (words), least recently used evicted
    first: a prompt's prefill costs only the tokens past the leading blocks it holds. 0: none."""
    prefix_summary_size: int = 4096
    """Prompt prefixes (links of their prefix chains: a prompt's leading 1 KiB pieces) a worker reports holding, the
    least recently used dropped first: what cache-aware dispatch reads (docs/cache-aware-dispatch.md). 0: none."""
    max_model_len: int = 2048
    """Context length the worker allows (prompt plus completion tokens)."""
    max_num_seqs: int = 32
    """Sequences one worker runs at once (its slots: a job takes one per sequence); it pulls new jobs only while it
    has free slots, and the edge refuses a job with more sequences than that."""
    stream_interval: int = 1
    """Tokens a stream gathers before the worker sends them on (vLLM's --stream-interval): 1 sends every token
    as the engine makes it; more sends a stream's tokens in fewer, larger events, which costs the worker, Redis
    and the edge less CPU per token, at the price of smoothness. A stream's first token and its last are always
    sent at once. The vLLM engine only (the simulated engine sends every token)."""
    kv_cache_gib: float = 2.0
    """KV cache size for the CPU engine (sets VLLM_CPU_KVCACHE_SPACE when that is unset)."""
    dtype: str = "auto"
    """Engine dtype; auto is the model's own on a GPU and float32 on the CPU (bf16 there gave garbage)."""
    gpu_memory_utilization: float = 0.85
    """Share of GPU memory the engine may take (GPU builds only)."""
    enforce_eager: bool = False
    """Run the engine without CUDA graphs or torch.compile (vLLM's --enforce-eager): it starts sooner, takes
    less GPU memory and decodes slower. The CPU engine always runs eager (compiling there costs minutes)."""
    grammar_compile_s: float = 5.0
    """How long a request's constraint (a JSON schema, regex, choice or structural tag) may take to compile, as the
    engine's XGrammar would take it on this host (its 8 threads, on as many cores as there are): the worker compiles
    it first in a helper process and allows it that many seconds of CPU time per such core. Past them the request is
    a 400 (invalid_structured_output) and the engine never sees it; a compile the busy host does not let finish within
    20 times as long in wall time is a 503. 0: no such check (the engine compiles every constraint, however long it
    takes, while other constrained requests wait). The vLLM engine only."""
    request_timeout_s: float = 600.0
    """Deadline of one request from arrival to its last token."""
    response_ttl_s: float = 30 * 24 * 3600.0
    """How long stored Responses-API responses stay retrievable (store: true)."""
    storage_bytes: int = 64 * 1024 * 1024
    """Bytes a tenant may hold stored (responses, resumable streams' requests) under a key made without its own
    --storage-bytes; 0: no limit."""
    storage_items: int = 10000
    """Stored responses a tenant may hold under a key made without its own --storage-items; 0: no limit."""
    heartbeat_interval_s: float = 2.0
    """How often a worker refreshes its heartbeat."""
    heartbeat_ttl_s: float = 6.0
    """How long a worker's heartbeat outlives it."""
    redis_pool_size: int = 4
    """Redis connections an edge uses for commands (one more reads its events); a worker uses three more."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body the edge accepts."""
    max_tenant_calls_in_flight: int = 8
    """Calls one tenant may have in flight on an edge at once to the routes that run no model (files,
    conversations, stored responses, batches, models), which spend no rpm; one more is a 429. 0: no bound."""
    max_stop_sequences: int = 16
    """Stop strings one request may give (TGI's --max-stop-sequences, which its /info reports; OpenAI allows 4,
    MindIE 1,024): the engine checks each on every token of the request, on the loop that streams every request's
    tokens (1,024 cost a millisecond a token)."""
    keepalive_interval_s: float = 15.0
    """Seconds between SSE keep-alive comments while a stream waits."""
    metrics_port: int = 0
    """Port of the process's Prometheus endpoint (`/metrics` of an edge or a worker; never the API's port: the
    metrics name tenants); 0 means none. `tokenbus run` serves its edge's there and its workers' on the next
    ports."""
    metrics_host: str = ""
    """Address the metrics endpoint listens on; empty: --host's. In a pod 0.0.0.0 (Prometheus scrapes the pod's
    address); on a shared host keep it private."""
    log_level: str = "INFO"
    """Logging level of every process."""
    log_format: str = "text"
    """text, or json: one JSON object per line with the request id (x-request-id) of what it is about."""
    event_loop: str = "uvloop"
    """uvloop (libuv's loop: fewer system calls and cheaper wake-ups per streamed token), or asyncio's own."""
    resume_window_s: float = 10.0
    """How long a job keeps running after its client (or its edge) went away, so that the client can resume
    it on any edge with Last-Event-ID; 0 aborts it within a second of the disconnect."""
    replay_ttl_s: float = 300.0
    """How long a finished job's events stay replayable (its event log in Redis)."""
    background_ttl_s: float = 24 * 3600.0
    """How long a background response's events stay in Redis after its end (charged to its tenant's storage):
    a client streams it from the start within this, and any edge finishes storing it from them."""
    batch_window: int = 64
    """Lines of one batch an edge has queued or running at once (the rest wait their turn in Redis)."""
    batch_max_open: int = 8
    """Batches one tenant may have open at once (validating to finalizing); 0: no limit."""
    batch_lease_ttl_s: float = 10.0
    """How long the lease of the edge driving a batch lasts unrenewed: after an edge's death, another takes its
    batches over within about this."""
    replay_max_events: int = 20000
    """Most events one job's log keeps (Redis memory bound); a job that outgrows it cannot resume or migrate. A
    background response's log keeps all of its events: it is its only record until an edge stores its answer."""
    max_reclaims: int = 3
    """Owners that may die running one job before it goes to the dead-letter stream."""
    worker_grace_s: float = 30.0
    """On SIGTERM a worker finishes its running jobs for this long, then hands the rest to other workers."""
    shutdown_grace_s: float = 120.0
    """On SIGTERM an edge stops accepting and lets its streams finish for this long (covers long streams)."""
    redis_down_after_s: float = 2.0
    """How long Redis may stay unreachable before an edge fails the streams it is serving."""
    max_buffered_events: int = 4096
    """Events one stream may hold for a client that reads slower than they come; past it the client is
    dropped and its job stopped (an edge's memory must not grow with slow clients)."""
    max_tenant_behind_bytes: int = 16 * 1024 * 1024
    """Bytes an edge holds at most for one tenant's streaming clients that read slower than their events come (the
    events waiting for them, as sized on the bus, and what was written that they have not taken); past it the
    tenant's client furthest behind is dropped and its job stopped, as past --max-buffered-events: however many
    streams a key may open, the clients that read nothing cost an edge this much. Without keys, every client is
    one tenant. 0: no bound."""
    read_timeout_s: float = 30.0
    """Seconds an edge gives a client to send a request's head, and again its body; slower ones are dropped."""
    write_stall_s: float = 60.0
    """Seconds a streaming client may leave the edge's writes unread (its socket full) before its connection is
    dropped (a client that reads nothing would otherwise hold its request, and what it has not read, for good)."""
    ready_models: str = ""
    """Models this deployment serves, comma-separated: the edge's /ready is 503 until each has a live worker
    (empty: the edge's --model)."""
    auth: str = "keys"
    """keys: every API route needs an API key (`tokenbus keys create`); none: anyone may call (`tokenbus run`
    serves without keys unless told otherwise)."""
    key_cache_s: float = 5.0
    """How long an edge trusts a key record it read; a revoke reaches every edge at once regardless."""
    lease_ttl_s: float = 15.0
    """A concurrency lease outlives its edge by at most this long (edges renew theirs on their heartbeat's beats,
    three or more times within it)."""
    admission_when_redis_down: str = "closed"
    """What an edge does with a key's limits when Redis cannot answer the admission step: closed (refuse
    with 503), open (admit without limits), local (each edge enforces an equal part of every limit itself)."""
    metrics_max_tenants: int = 20
    """Tenants that get their own label in the metrics; the rest are counted as `other`."""
    scheduler: str = "fair"
    """How a model's workers pick the next job: fair (per-tenant queues, virtual token counters) or fifo."""
    dispatch: str = "aware"
    """Where the fair scheduler sends a job (an edge's setting): aware (to a worker whose engine holds its prompt's
    prefix, when one has room; docs/cache-aware-dispatch.md) or blind (whichever worker reads first)."""
    prompt_cache: str = "tenant"
    """Whose prompts share the engines' prompt cache (an edge's setting): tenant (each tenant's own: a cached prompt
    answers sooner, so a shared cache lets one tenant tell whether another sent a prompt) or shared (every tenant's,
    for prompts nobody keeps secret: a system prompt many tenants send is computed once)."""
    affinity_wait_ms: int = 250
    """Cache-aware dispatch: how long a job may wait for a busy worker that holds its prompt's prefix before any
    worker takes it (an edge's setting; 0: never waits)."""
    fair_input_weight: float = 1.0
    """Fair share: what one prompt token costs a tenant's counter."""
    fair_output_weight: float = 2.0
    """Fair share: what one generated token costs a tenant's counter."""
    fair_headroom: float = 0.0625
    """Fair share: sequences a worker runs beyond --max-num-seqs (this share of it, rounded down), only for tenants
    holding no more than that many: a tenant that comes in while another keeps every slot busy finds one free at
    once, rather than waiting for one to end, and a tenant alone still fills every slot. A worker's setting; 0:
    none."""
    max_queued_jobs: int = 4096
    """Jobs one model may hold queued (not yet running); past it new requests get 503 at once."""
    max_queued_per_tenant: int = 1024
    """Jobs one tenant may hold queued for one model; past it its new requests get 429 at once."""
    max_queued_bytes_per_tenant: int = 64 * 1024 * 1024
    """Bytes of jobs one tenant may hold queued for one model (Redis memory is everyone's; a job is about the size
    of its request); past it its new requests get 429 at once, though a tenant with nothing queued may always
    queue one. 0: no bound."""
    queue_timeout_s: float = 120.0
    """A job that waited longer than this for a worker is never started; its client gets an error (from its edge,
    when no worker has started it a few seconds past this)."""


class SlotSettings(Protocol):
    """What a worker's sequences at once follow from."""

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def fair_headroom(self) -> float: ...
    @property
    def scheduler(self) -> str: ...


def headroom_seqs(settings: SlotSettings) -> int:
    """Sequences a worker runs beyond max_num_seqs for tenants using little (fair_headroom; none with fifo)."""
    return int(settings.max_num_seqs * settings.fair_headroom) if settings.scheduler == "fair" else 0


def engine_seqs(settings: SlotSettings) -> int:
    """Sequences a worker's engine runs at once: its slots and the headroom beyond them."""
    return settings.max_num_seqs + headroom_seqs(settings)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_value(kind: type, raw: str) -> Any:
    return msgspec.convert(raw, kind, strict=False)


def field_docs() -> dict[str, str]:
    """The one-line description of each setting, taken from the docstrings above."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(Settings))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if isinstance(prev, ast.AnnAssign) and isinstance(node, ast.Expr):
            docs[prev.target.id] = node.value.value  # type: ignore[union-attr, attr-defined]
    return docs


def add_arguments(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """Adds a flag for each named setting; defaults stay unset so the environment can fill them."""
    docs = field_docs()
    defaults = Settings()
    for name in names:
        env = ENV_PREFIX + name.upper()
        default = getattr(defaults, name)
        parser.add_argument(
            _flag(name), dest=name, default=None, metavar=type(default).__name__.upper(),
            help=f"{docs.get(name, '')} [env {env}, default {default!r}]",
        )


def load(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Builds the settings: flags win over environment variables, which win over defaults."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(Settings):
        raw = getattr(args, field.name, None) if args is not None else None
        if raw is None:
            raw = environ.get(ENV_PREFIX + field.name.upper())
        if raw is not None:
            try:
                values[field.name] = _parse_value(field.type, raw)
            except msgspec.ValidationError as exc:
                raise SystemExit(f"invalid setting {field.name}={raw!r}: {exc}") from None
    settings = Settings(**values)
    if settings.task not in TASKS:
        raise SystemExit(f"invalid setting task={settings.task!r}: choose one of {', '.join(TASKS)}")
    for name, allowed in (("auth", AUTH_MODES), ("log_format", LOG_FORMATS), ("event_loop", EVENT_LOOPS),
                          ("admission_when_redis_down", REDIS_DOWN_POLICIES), ("scheduler", SCHEDULERS),
                          ("dispatch", DISPATCHES), ("prompt_cache", PROMPT_CACHES)):
        if getattr(settings, name) not in allowed:
            raise SystemExit(f"invalid setting {name}={getattr(settings, name)!r}: choose one of {', '.join(allowed)}")
    if settings.engine not in ENGINES:
        raise SystemExit(f"invalid setting engine={settings.engine!r}: choose one of {', '.join(ENGINES)}")
    if settings.stream_interval < 1:
        raise SystemExit(f"invalid setting stream_interval={settings.stream_interval}: at least 1 token")
    return settings
