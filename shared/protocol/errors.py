"""The error hierarchy: each error has a stable `type`, an optional `code` and an HTTP status.

    TokenbusError                  500 server_error
    ├── InvalidRequest             400 invalid_request_error (names the offending `param`)
    │   ├── ContextLengthExceeded  400 invalid_request_error / context_length_exceeded
    │   ├── PayloadTooLarge        413 invalid_request_error / body_too_large
    │   ├── MethodNotAllowed       405 invalid_request_error / method_not_allowed
    │   └── UnsupportedMediaType   415 invalid_request_error / unsupported_media_type (a body that is not JSON)
    ├── Unauthenticated            401 invalid_request_error / invalid_api_key
    ├── HostNotAllowed             403 invalid_request_error / host_not_allowed (a keyless edge's guard)
    ├── RateLimited                429 requests|tokens|concurrency / rate_limit_exceeded (+ `retry_after_s`)
    │   └── QuotaExceeded          429 insufficient_quota / insufficient_quota
    │       └── StorageFull        429 insufficient_quota / storage_quota_exceeded (the tenant's stored bytes)
    ├── NotFound                   404 invalid_request_error / not_found
    │   └── ModelNotFound          404 invalid_request_error / model_not_found
    ├── Overloaded                 503 overloaded_error
    │   ├── Unavailable            503 overloaded_error / redis_unavailable (the queue cannot be reached)
    │   ├── QueueFull              503 overloaded_error / queue_full (the model holds max_queued_jobs)
    │   ├── WaitExceedsDeadline    503 overloaded_error / wait_exceeds_deadline (the estimated wait is longer)
    │   ├── QueueTimeout           503 overloaded_error / queue_timeout (it waited over queue_timeout_s)
    │   └── ModelUnavailable       503 overloaded_error / model_unavailable (a model served here has no live
    │                              worker now: its workers are restarting)
    ├── TenantQueueFull            429 rate_limit_error / tenant_queue_full (the tenant's own queue bound)
    ├── WorkerLost                 503 server_error / worker_lost (its worker died, nobody could continue)
    ├── StreamAbandoned            410 invalid_request_error / stream_abandoned (not resumed in time)
    ├── RequestTimeout             504 timeout_error
    └── EngineError                500 server_error

Errors cross the bus as `bus.Error` events (see `to_event` / `from_event`) and leave the edge in each API's own
shape, rendered by the format modules. A refusal that a client may retry can say when (`retry_after_s`, the
Retry-After header).
"""

from __future__ import annotations


class TokenbusError(Exception):
    """Base of every error a client can see."""

    status = 500
    type = "server_error"
    code: str | None = None
    retry_after_s: float | None = None
    """When a client should try again (429 and 503); None: the edge's default."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class InvalidRequest(TokenbusError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class PreviousResponseNotFound(InvalidRequest):
    """A `previous_response_id` that names no stored response (or a chain with one deleted): OpenAI's 400, which
    clients that keep their own history answer by sending the whole conversation again."""

    code = "previous_response_not_found"


def prompt_scores_unavailable(model: str, param: str) -> InvalidRequest:
    """A request for a prompt's logprobs (an echo with logprobs, TGI's decoder_input_details) to a model whose
    workers run LoRA adapters: vLLM fails its engine core computing them there (vLLM issues 29955, 16668)."""
    return InvalidRequest(f"`{model}` is served where the engine cannot compute a prompt's logprobs (with LoRA "
                          f"adapters enabled, or by workers older than this server): ask without `{param}`, or of "
                          "a model served without adapters.", param=param, code="prompt_logprobs_unavailable")


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "body_too_large"


class MethodNotAllowed(InvalidRequest):
    status = 405
    code = "method_not_allowed"


class UnsupportedMediaType(InvalidRequest):
    status = 415
    code = "unsupported_media_type"


class HostNotAllowed(TokenbusError):
    status = 403
    type = "invalid_request_error"
    code = "host_not_allowed"


class Unauthenticated(TokenbusError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RateLimited(TokenbusError):
    """Refused by one of the key's limits; `type` names it as OpenAI does (requests, tokens), and
    `retry_after_s` says when the same request would be admitted."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, limit: str = "requests", retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.type = limit
        self.retry_after_s = retry_after_s
        self.headers: dict[str, str] = {}
        """The key's x-ratelimit-* headers at the refusal."""


class QuotaExceeded(RateLimited):
    type = "insufficient_quota"
    code = "insufficient_quota"


class StorageFull(QuotaExceeded):
    """The tenant's storage quota is full. A 429 as OpenAI's insufficient_quota, not a 400 (the request is
    well-formed; the same one succeeds once space is freed), with `x-should-retry: false`: waiting seconds does
    not free storage, only a delete, an expiry or `store: false` does, so the SDKs must not retry by themselves."""

    code = "storage_quota_exceeded"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float = 60.0) -> None:
        super().__init__(message, limit="insufficient_quota", retry_after_s=retry_after_s)
        self.param = param
        self.headers = {"x-should-retry": "false"}


class NotFound(TokenbusError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Overloaded(TokenbusError):
    status = 503
    type = "overloaded_error"


class Unavailable(Overloaded):
    code = "redis_unavailable"


class QueueFull(Overloaded):
    code = "queue_full"


class WaitExceedsDeadline(Overloaded):
    code = "wait_exceeds_deadline"


class QueueTimeout(Overloaded):
    code = "queue_timeout"


class ModelUnavailable(Overloaded):
    code = "model_unavailable"


class AdapterUnavailable(TokenbusError):
    """A LoRA adapter its model's workers cannot run (not served there, or its files would not load): not a load
    that passes, so no batch line waits for it."""

    status = 503
    type = "server_error"
    code = "adapter_unavailable"


class TenantQueueFull(TokenbusError):
    status = 429
    type = "rate_limit_error"
    code = "tenant_queue_full"


class WorkerLost(TokenbusError):
    status = 503
    type = "server_error"
    code = "worker_lost"


class StreamAbandoned(TokenbusError):
    status = 410
    type = "invalid_request_error"
    code = "stream_abandoned"


class RequestTimeout(TokenbusError):
    status = 504
    type = "timeout_error"


class EngineError(TokenbusError):
    status = 500
    type = "server_error"


_BY_NAME: dict[str, type[TokenbusError]] = {
    cls.__name__: cls
    for cls in (TokenbusError, InvalidRequest, Unauthenticated, RateLimited, QuotaExceeded, StorageFull,
                ContextLengthExceeded, PayloadTooLarge, MethodNotAllowed,
                ModelNotFound, NotFound, Overloaded, Unavailable, QueueFull, WaitExceedsDeadline, QueueTimeout,
                ModelUnavailable,
                TenantQueueFull, WorkerLost, StreamAbandoned, RequestTimeout, AdapterUnavailable,
                EngineError)
}


def kind_of(error: TokenbusError) -> str:
    """The name an error travels under on the bus."""
    return type(error).__name__


def from_kind(kind: str, message: str, param: str | None, code: str | None) -> TokenbusError:
    """Rebuilds an error that crossed the bus; an unknown kind becomes a plain server error."""
    return _BY_NAME.get(kind, TokenbusError)(message, param=param, code=code)
