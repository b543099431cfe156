"""Each tenant's calls in flight on this edge to the routes that run no model (files, conversations, stored
responses, batches, the model list): at most --max-tenant-calls-in-flight at once, one more is a 429. Those routes
spend none of a key's rpm (a client polls a background response, pages a list), so this is what bounds the memory
and loop time one tenant's uploads, downloads and reads take on an edge. A resumed stream leaves the gate when it
starts: its key's rpm and its readers' cap meter it (see handlers.resume)."""

from __future__ import annotations

from aiohttp import web

from shared.protocol.errors import RateLimited

GATED: web.RequestKey[str] = web.RequestKey("gated_tenant", str)


class CallGate:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        """0: no bound."""
        self.in_flight: dict[str, int] = {}

    def enter(self, request: web.Request, tenant: str) -> None:
        """Counts the request in, or refuses it (RateLimited) when its tenant has `limit` calls in flight here."""
        count = self.in_flight.get(tenant, 0)
        if self.limit and count >= self.limit:
            raise RateLimited(f"Your calls to this server that run no model are at their limit of {self.limit} at "
                              "once; wait for one to end.", limit="concurrency", retry_after_s=1.0)
        self.in_flight[tenant] = count + 1
        request[GATED] = tenant

    def leave(self, request: web.Request) -> None:
        """Counts the request out (once; nothing if it was never counted in)."""
        tenant = request.get(GATED)
        if tenant is None:
            return
        del request[GATED]
        if (count := self.in_flight[tenant] - 1) > 0:
            self.in_flight[tenant] = count
        else:
            del self.in_flight[tenant]
