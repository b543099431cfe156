"""Every Redis key, stream, group and channel name tokenbus uses, in one place."""

import functools
import hashlib

PREFIX = "tokenbus"

WORKER_GROUP = "workers"
"""Consumer group that every worker of a model reads its request stream through."""

CANCEL_CHANNEL = f"{PREFIX}:cancel"
"""Pub/sub channel on which edges name jobs to abort; every worker listens."""

WORKERS = f"{PREFIX}:workers"
"""Sorted set of worker heartbeat keys, scored by when each last beat expires (unix seconds): edges read
the live workers from it instead of scanning the keyspace."""


def requests_stream(model: str) -> str:
    """The stream of jobs for one model, read by its workers through WORKER_GROUP."""
    return f"{PREFIX}:requests:{{{model}}}"


def events_channel(edge_id: str) -> str:
    """The shard channel (SPUBLISH) on which workers publish token events for the jobs of one edge process,
    after writing them to the jobs' logs."""
    return f"{PREFIX}:events:{{{edge_id}}}"


def worker_requests(model: str, worker_id: str) -> str:
    """A worker's own stream of jobs, beside its model's (and in its hash slot): the jobs cache-aware dispatch placed
    on it, read through WORKER_GROUP with the model's stream in one read."""
    return f"{requests_stream(model)}:{worker_id}"


def worker_streams(model: str) -> str:
    """Set of the workers of a model that have a stream of their own: where a dead worker's jobs are looked for."""
    return f"{PREFIX}:fair:{{{model}}}:streams"


def worker_heartbeat(model: str, worker_id: str) -> str:
    """A worker's heartbeat: it expires when the worker stops refreshing it."""
    return f"{PREFIX}:worker:{model}:{worker_id}"


def model_of_heartbeat(name: bytes | str) -> str:
    """The model of a worker_heartbeat key (a worker id holds no colon; a model name may)."""
    text = name.decode() if isinstance(name, bytes) else name
    return text.removeprefix(f"{PREFIX}:worker:").rsplit(":", 1)[0]


def cancelled(job_id: str) -> str:
    """Marks a job cancelled, so a worker that picks it up later never starts it."""
    return f"{PREFIX}:cancelled:{job_id}"


def tenant_tag(tenant: str) -> str:
    """The hash tag of a tenant's stored data: a digest, so that any tenant name (braces included) makes one tag,
    and every key of one tenant's storage lies in one Redis Cluster slot (its quota is kept in one script)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


def stored_response(tenant: str, response_id: str) -> str:
    """A finished Responses-API response and its part of the conversation, for GET and previous_response_id."""
    return f"{PREFIX}:response:{{{tenant_tag(tenant)}}}:{response_id}"


def conversation(tenant: str, conversation_id: str) -> str:
    """A Conversations-API conversation: its id, creation time and metadata (JSON)."""
    return f"{PREFIX}:conversation:{{{tenant_tag(tenant)}}}:{conversation_id}"


def conversation_items(tenant: str, conversation_id: str) -> str:
    """A conversation's items, oldest first (a list of JSON items)."""
    return f"{PREFIX}:conversation:{{{tenant_tag(tenant)}}}:{conversation_id}:items"


def conversation_turns(tenant: str, conversation_id: str) -> str:
    """The responses whose turns a conversation holds (a set): each is added once."""
    return f"{PREFIX}:conversation:{{{tenant_tag(tenant)}}}:{conversation_id}:turns"


def file(tenant: str, file_id: str) -> str:
    """An uploaded file's description (JSON: name, purpose, size, creation time)."""
    return f"{PREFIX}:file:{{{tenant_tag(tenant)}}}:{file_id}"


def file_chunks(tenant: str, file_id: str) -> str:
    """An uploaded file's bytes, in chunks (a list), so that no one Redis command moves all of a large file."""
    return f"{PREFIX}:file:{{{tenant_tag(tenant)}}}:{file_id}:chunks"


def file_chunks_writing(tenant: str, file_id: str, writer: str) -> str:
    """A file's chunks while one writer (`writer`, its own id) writes them (a batch's output file): renamed to
    file_chunks once whole."""
    return f"{PREFIX}:file:{{{tenant_tag(tenant)}}}:{file_id}:writing:{writer}"


def files(tenant: str) -> str:
    """A tenant's files (a sorted set of ids by creation time, ms): what GET /v1/files lists."""
    return f"{PREFIX}:files:{{{tenant_tag(tenant)}}}"


def batch(tenant: str, batch_id: str) -> str:
    """A batch (hash): `info` (the Batch as JSON, its status and times), `cancel` (when a cancel was asked, ms), and
    its tallies: `completed`, `failed`, `input_tokens`, `output_tokens`, `output_bytes`."""
    return f"{PREFIX}:batch:{{{tenant_tag(tenant)}}}:{batch_id}"


def batch_lines(tenant: str, batch_id: str) -> str:
    """A batch's answered lines (hash: custom_id -> its output line, prefixed `o` for the output file or `e` for the
    error file): set once per custom_id, whoever answers it (exactly once, across edge deaths)."""
    return f"{PREFIX}:batch:{{{tenant_tag(tenant)}}}:{batch_id}:lines"


def batches(tenant: str) -> str:
    """A tenant's batches (a sorted set of ids by creation time, ms): what GET /v1/batches lists."""
    return f"{PREFIX}:batches:{{{tenant_tag(tenant)}}}"


def batches_running(tenant: str) -> str:
    """A tenant's open batches (a set of ids): at most --batch-max-open."""
    return f"{PREFIX}:batches:{{{tenant_tag(tenant)}}}:open"


BATCHES_OPEN = f"{PREFIX}:batches:open"
"""Sorted set of every tenant's unfinished batches (members `tenant` NUL `batch id`, by creation time, ms): what
every edge looks through for a batch no edge drives."""


def batch_driver(batch_id: str) -> str:
    """The lease of the edge driving a batch (its events channel, with a short expiry it renews)."""
    return f"{PREFIX}:batchdriver:{{{batch_id}}}"


def storage_tally(tenant: str) -> str:
    """Hash of what one tenant holds stored: `bytes` and `items` in all, and each item's bytes by its member
    (r:<response id>, c:<conversation id>, f:<file id>, a:<batch id> (its record), b:<batch id> (its answers until
    its files take their place), s:<job id>, l:<job id>: see shared.tenancy.storage)."""
    return f"{PREFIX}:storage:{{{tenant_tag(tenant)}}}:tally"


def storage_expiry(tenant: str) -> str:
    """Sorted set of one tenant's stored items (the members of its tally), scored by when each expires (unix ms):
    what gives an expired item's bytes back."""
    return f"{PREFIX}:storage:{{{tenant_tag(tenant)}}}:expiry"


ROUTE_CHANNEL = f"{PREFIX}:route"
"""Pub/sub channel on which an edge that resumes a stream tells the job's owner where to send events now,
and an edge whose client left tells it how long to keep the job for a resume (see bus.Route)."""


EDGES = f"{PREFIX}:edges"
"""Sorted set of live edges' events channels, scored by when each edge's heartbeat expires (unix seconds)."""


def edges_alive(reply_to: str) -> str:
    """An edge's heartbeat, named after its events channel: workers abort (or keep for a resume) the jobs of
    an edge whose heartbeat expired."""
    return f"{reply_to}:alive"


def job_log(job_id: str) -> str:
    """Every event of one job, in order (a stream): what a resumed stream replays and what a worker that
    takes the job over continues from. It expires a while after the job ends."""
    return f"{PREFIX}:log:{{{job_id}}}"


def job_record(job_id: str) -> str:
    """How a streamed job was asked for (route, body, creation time), so that any edge can resume it."""
    return f"{PREFIX}:stream:{{{job_id}}}"


def job_owners(job_id: str) -> str:
    """Hash of a job's hand-over counters: `epoch` (owners after the first) and `reclaims` (owners that died)."""
    return f"{PREFIX}:owners:{{{job_id}}}"


def job_reply_to(job_id: str) -> str:
    """The events channel a resumed job now reports to, when an edge other than its first one took it."""
    return f"{PREFIX}:replyto:{{{job_id}}}"


def prefixes(model: str, worker_id: str) -> str:
    """Set of the prompt prefixes (prefix chain links, shared.protocol.prefixes) a worker's engine holds, bounded
    by its summary's capacity and expiring with its heartbeat: what cache-aware placement reads (the dispatch script
    names it from the model's request stream: `requests` becomes `prefixes`, then `:<worker>`)."""
    return f"{PREFIX}:prefixes:{{{model}}}:{worker_id}"


def dead_letters(model: str) -> str:
    """Jobs of a model taken off its queue after too many owners died running them, with the reason."""
    return f"{PREFIX}:deadletter:{{{model}}}"


# tenancy: every key of one API key's limits, usage and settlements shares the hash tag {key id}


API_KEYS = f"{PREFIX}:apikeys"
"""Hash of every API key: key id -> the key's record (its hash, tenant, limits); never the key itself."""

KEY_CHANGES_CHANNEL = f"{PREFIX}:apikeys:changed"
"""Pub/sub channel naming a key id whose record changed or was revoked: edges drop it from their cache."""


ADAPTERS = f"{PREFIX}:adapters"
"""Hash of the LoRA adapters added at run time (`tokenbus adapters add`): name -> its record (base model, path,
owning tenant)."""


def api_key_by_hash(key_hash: str) -> str:
    """An API key's SHA-256 hash -> its id: what an edge looks a presented key up by. Tagged with API_KEYS's
    name, so that a key's record and its hash change together, in one slot of a Redis Cluster."""
    return f"{{{API_KEYS}}}:hash:{key_hash}"


def rate_requests(key_id: str) -> str:
    """GCRA state (theoretical arrival time, unix ms) of one key's requests per minute."""
    return f"{PREFIX}:limit:{{{key_id}}}:rpm"


def rate_tokens(key_id: str) -> str:
    """GCRA state of one key's tokens per minute."""
    return f"{PREFIX}:limit:{{{key_id}}}:tpm"


def background_of_key(key_id: str) -> str:
    """Set of the background jobs one key started lately (kept a request timeout after the latest): a revoke
    cancels them, whichever edge follows them, or none."""
    return f"{PREFIX}:background:{{{key_id}}}"


def leases(key_id: str) -> str:
    """Sorted set of one key's concurrency leases, scored by when each expires (unix ms)."""
    return f"{PREFIX}:leases:{{{key_id}}}"


def quota(key_id: str, window: str) -> str:
    """Tokens one key spent in one quota period (e.g. 2026-11, or 2026-11-23)."""
    return f"{PREFIX}:quota:{{{key_id}}}:{window}"


def usage(key_id: str, day: str) -> str:
    """Hash of one key's usage on one day (UTC): `tenant`, and `<model>|requests|prompt|completion` counts."""
    return f"{PREFIX}:usage:{{{key_id}}}:{day}"


def settled(key_id: str, job_id: str) -> str:
    """Marks a job's charge settled, so that a job two workers end (a migration race) is counted once."""
    return f"{PREFIX}:settled:{{{key_id}}}:{job_id}"


FAIR_KEY_NAMES = ("ready", "backlog", "jobs", "costs", "counters", "queued", "state", "slots", "inflight", "affinity")
"""The fair-share scheduler's keys of a model (see shared.tenancy.fairshare), all under the model's hash tag like its
request stream, so that each of its scripts touches one Redis Cluster slot:

    ready     sorted set (by name): the backlogged tenants of each priority band, ordered by their counters
    backlog   sorted set (by name): every queued job, per band and tenant in arrival order
    jobs      hash: a queued job's encoded form, by its backlog member
    costs     hash: what a queued job will charge its tenant's counter, and its token prices
    counters  hash: each band and tenant's virtual token counter
    queued    hash: jobs each tenant holds queued
    state     hash: queued jobs (in all and per band), the last counter served in each band, the sequence of
              backlog members, the moving average of a job's duration
    slots     hash: the slots each live worker offers, with when its offer expires and how many it keeps as headroom
    inflight  hash: the slots each band and tenant's jobs on the request stream take (dispatched, not yet ended)
    affinity  hash: a queued job's prefix chain and how long it may wait for a worker that holds it, by its member
"""


def fair_key(model: str, name: str) -> str:
    """One of FAIR_KEY_NAMES for one model."""
    return f"{PREFIX}:fair:{{{model}}}:{name}"


@functools.lru_cache(maxsize=1024)
def fair_keys(model: str) -> tuple[str, ...]:
    """Every key a fair-share script takes, in its order: FAIR_KEY_NAMES, then the model's request stream (made
    once per model: every request's enqueue names them)."""
    return (*(fair_key(model, name) for name in FAIR_KEY_NAMES), requests_stream(model))
