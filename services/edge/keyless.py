"""What keeps a web page off an edge that serves without keys (`--auth none`, as `tokenbus run` does).

A browser lets any page send a "simple" cross-site POST (a form's content types, no custom headers) and,
after DNS rebinding, read answers from a name that resolves to 127.0.0.1. An API key stops both, since a page
cannot send one it does not know; without keys the edge instead takes only JSON bodies (a JSON POST from
another site needs a CORS preflight, which the edge never grants; so does a file upload that carries an
Authorization header, as the SDKs' do, whatever the key in it) and only Hosts that are IP addresses,
`localhost`, a name without a dot (a compose service, a hosts-file name: no public DNS answers for one) or the
address it listens on. A rebound name is none of those: it is a public name the attacker controls.
"""

from __future__ import annotations

import ipaddress

from aiohttp import web

from shared.protocol.errors import HostNotAllowed, UnsupportedMediaType

LOCAL_NAMES = frozenset({"localhost"})


def check(request: web.Request, listen_host: str) -> None:
    """Refuses a request a browser could have sent on a web page's behalf."""
    if not _allowed_host(request.host, listen_host):
        raise HostNotAllowed("This edge serves without API keys and only answers requests addressed to an IP "
                             "address or localhost; use an API key to serve other names.")
    if request.method == "POST" and request.can_read_body and not _is_json(request.content_type) and not (
            request.content_type == "multipart/form-data" and "Authorization" in request.headers):
        raise UnsupportedMediaType("The request body must be JSON (`Content-Type: application/json`), or a file "
                                   "upload (multipart/form-data) with an Authorization header.",
                                   param="Content-Type")


def _allowed_host(host: str, listen_host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.strip("[]").lower()
    if name in LOCAL_NAMES or name.endswith(".localhost") or name == listen_host.lower() or "." not in name:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")
