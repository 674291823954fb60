"""The HTTP side channel of remote partial fetching: how a decode node finds and reads a prefill node's
hand-offs, and who may call it.

The prefill scheduler process serves its hand-offs itself (it owns the staged memory, ``HandoffServer``)
and registers the server's URL per engine rank with the prefill's own bootstrap server
(``register_handoffs``, at ``ENDPOINT_ROUTE``, a route hook 7 in ``sglang_hooks`` adds); a decode node
looks it up there from a request's bootstrap address (``EndpointDirectory``).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

logger = logging.getLogger(__name__)

ENDPOINT_ROUTE = "/oasis/remote_fetch_endpoint"  # on the prefill's bootstrap server
HTTP_TIMEOUT_S = 10.0
TOKEN_ENV = "SGLANG_OASIS_PD_TOKEN"  # a deployment's shared secret (launch_pd makes one)
TOKEN_HEADER = "X-Oasis-PD-Token"
# A decode node that fetches names its SGLang transfer session when it asks for a hand-off: the prefill
# node stages only for decode sessions that did (the others, and each new one's first requests, go whole).
DECODE_SESSION_HEADER = "X-Oasis-Decode-Session"
UNREACHABLE_TTL_S = 10.0  # how long a bootstrap server that did not answer is not asked again


def _auth_headers() -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV)
    return {TOKEN_HEADER: token} if token else {}


def authorized(headers: Any, client_host: str | None) -> bool:
    """Whether a caller of the hand-off routes (which hand out, register and release staged KV) may: with
    ``SGLANG_OASIS_PD_TOKEN`` set, it sends the same token; without, it calls from this machine."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return hmac.compare_digest(str(headers.get(TOKEN_HEADER, "")), token)
    try:
        return client_host is not None and ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False


def reachable(address: str, via: str) -> str:
    """``address`` (a URL, or a Mooncake session ``host:port``) with a wildcard host (a server bound to
    every interface advertises 0.0.0.0 or ::) replaced by ``via``, the host this node reached the peer's
    bootstrap server at; any other address as it is."""
    url = "://" in address
    parsed = urllib.parse.urlsplit(address if url else f"//{address}")
    if parsed.hostname not in ("0.0.0.0", "::"):
        return address
    host = f"[{via}]" if ":" in via else via
    rebuilt = parsed._replace(netloc=host if parsed.port is None else f"{host}:{parsed.port}").geturl()
    return rebuilt if url else rebuilt.removeprefix("//")


def open_url(address: str, method: str = "GET", data: bytes | None = None, session: str | None = None) -> Any:
    """One call of the side channel, with the deployment's token and this node's transfer ``session``."""
    headers = _auth_headers() | ({DECODE_SESSION_HEADER: session} if session else {})
    request = urllib.request.Request(address, data=data, method=method, headers=headers)
    return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)


class RemoteFetchError(RuntimeError):
    """The hand-off of a request could not be obtained or read; the request fails alone."""


class EndpointDirectory:
    """A decode node's look-up of prefill nodes' hand-off URLs by bootstrap address (one per
    ``DecodeFetcher``): the URLs found, the bootstrap servers that did not answer lately, and the prefill
    nodes already reported for running another ``--tp-size``."""

    def __init__(self, rank: int = 0, tp_size: int = 1) -> None:
        self.rank, self.tp_size = rank, tp_size  # this node's tensor-parallel rank and --tp-size
        self.unreachable_ttl_s = UNREACHABLE_TTL_S
        self._urls: dict[tuple[str, int], str] = {}  # bootstrap address -> hand-off URL
        self._unreachable: dict[tuple[str, int], tuple[str, float]] = {}  # address -> (failure, when)
        self._mismatched: set[tuple[str, int]] = set()  # addresses of prefill nodes with another --tp-size

    def known(self, bootstrap_host: str, bootstrap_port: int) -> str | None:
        """The hand-off URL found before for this bootstrap address, if any (never looks one up)."""
        return self._urls.get((bootstrap_host, int(bootstrap_port)))

    def url(self, bootstrap_host: str, bootstrap_port: int, fresh: bool = False) -> str | None:
        """The hand-off URL of the prefill node at this bootstrap address, reachable from here; None if it
        does not stage. ``fresh``: look it up again (a restarted prefill node serves at a new URL)."""
        key = (bootstrap_host, int(bootstrap_port))
        url = None if fresh else self._urls.get(key)
        if url is None:
            url = self.handoff_endpoint(bootstrap_host, bootstrap_port)
            if url is not None:
                url = self._urls[key] = reachable(url, bootstrap_host)
        return url

    def handoff_endpoint(self, bootstrap_host: str, bootstrap_port: int) -> str | None:
        """The hand-off URL that this node's tensor-parallel rank's counterpart (``rank``) on the prefill
        node at this bootstrap address registered with its bootstrap server; None if it does not stage KV,
        or runs another ``--tp-size`` than this node's ``tp_size`` (its ranks hold other KV heads than this
        node's: its requests arrive whole, as SGLang sends them; logged once per address). Raises
        ``RemoteFetchError`` if the bootstrap server cannot answer; that is remembered for
        ``unreachable_ttl_s``, so requests arriving meanwhile fail at once instead of each holding the
        decode scheduler's thread for the HTTP timeout."""
        key, now = (bootstrap_host, int(bootstrap_port)), time.monotonic()
        known = self._unreachable.get(key)
        if known is not None and now - known[1] < self.unreachable_ttl_s:
            raise RemoteFetchError(f"{known[0]} ({now - known[1]:.1f} s ago; not asked again yet)")
        address = f"http://{bootstrap_host}:{bootstrap_port}{ENDPOINT_ROUTE}?engine_rank={self.rank}"
        try:
            with open_url(address) as response:
                answer = json.loads(response.read())
                url, their_tp = str(answer["url"]), int(answer.get("tp_size", 1))
        except (ValueError, KeyError) as error:
            raise RemoteFetchError(f"bootstrap server {address} answered without a URL: {error}") from None
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise RemoteFetchError(f"bootstrap server {address} answered {error.code}") from None
            return None
        except (urllib.error.URLError, OSError) as error:
            message = f"bootstrap server {address} unreachable: {error}"
            self._unreachable[key] = (message, now)
            raise RemoteFetchError(message) from None
        if their_tp != self.tp_size:
            if key not in self._mismatched:
                self._mismatched.add(key)
                logger.error(
                    "oasis: the prefill node at %s:%d runs --tp-size %d and this decode node %d: remote "
                    "partial fetching needs the same on both; its requests arrive whole",
                    *key,
                    their_tp,
                    self.tp_size,
                )
            return None
        return url


def serve_endpoints(app: Any) -> None:
    """Add ``ENDPOINT_ROUTE`` to the prefill's bootstrap server (its aiohttp ``app``, hook 7): ``PUT``
    registers an engine rank's hand-off URL (``register_handoffs``), ``GET ?engine_rank=`` looks it up
    (404 until that rank registered: the decode node then takes the request whole). Callers must be
    ``authorized``: the URL hands out staged KV."""
    from aiohttp import web

    endpoints: dict[int, dict[str, object]] = {}  # engine (tensor-parallel) rank -> its URL, --tp-size

    async def handle(request: web.Request) -> web.Response:
        if not authorized(request.headers, request.remote):
            return web.json_response(
                {"error": f"forbidden: this deployment needs its {TOKEN_HEADER}"}, status=403
            )
        if request.method == "PUT":
            data = await request.json()
            endpoints[int(data["engine_rank"])] = {
                "url": str(data["url"]),
                "tp_size": int(data.get("tp_size", 1)),
            }
            return web.json_response({})
        endpoint = endpoints.get(int(request.query.get("engine_rank", 0)))
        if endpoint is None:
            return web.json_response({"error": "this prefill node does not stage KV"}, status=404)
        return web.json_response(endpoint)

    app.router.add_route("*", ENDPOINT_ROUTE, handle)


def register_handoffs(
    host: str, bootstrap_port: int, engine_rank: int, tp_size: int, url: str, ready: threading.Event
) -> None:
    """Tell the prefill's bootstrap server (started after this process) where this tensor-parallel rank's
    hand-offs are served (``url``; each rank stages its own KV heads), and the node's ``--tp-size``;
    retried until it answers, then ``ready`` is set. Runs on its own thread."""
    body = json.dumps({"engine_rank": engine_rank, "tp_size": tp_size, "url": url}).encode()
    address = f"http://{host}:{bootstrap_port}{ENDPOINT_ROUTE}"
    started = time.monotonic()
    while True:
        try:
            open_url(address, "PUT", body).read()
            ready.set()
            logger.info("oasis: hand-offs registered at %s", address)
            return
        except (urllib.error.URLError, OSError) as error:
            if time.monotonic() - started > 120:
                logger.warning(
                    "oasis: cannot register hand-offs at %s yet (%s); requests go whole", address, error
                )
                started = time.monotonic()
            time.sleep(0.5)


class HandoffSource(Protocol):
    """What the hand-off server serves from (the prefill node's ``PrefillStager``)."""

    def handoff(self, room: int, decode_session: str | None = None) -> bytes | None: ...
    def release(self, room: int) -> bool: ...
    def handoff_delay(self, room: int) -> float: ...


class HandoffServer:
    """``GET`` and ``DELETE /handoff/<room>`` for the deployment's callers (``authorized``), on its own
    threads in the prefill scheduler process."""

    def __init__(self, source: HandoffSource, host: str) -> None:
        self._server = ThreadingHTTPServer((host, 0), _handler(source))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="oasis-handoff", daemon=True).start()
        self.url = f"http://{host}:{self._server.server_address[1]}"


def _handler(source: HandoffSource) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _room(self) -> int | None:
            if not authorized(self.headers, self.client_address[0]):
                self._reply(403, b'{"error": "forbidden: this deployment needs its X-Oasis-PD-Token"}')
                return None
            prefix = "/handoff/"
            if not self.path.startswith(prefix):
                self._reply(404, b'{"error": "unknown path"}')
                return None
            try:
                return int(self.path[len(prefix) :])
            except ValueError:
                self._reply(400, b'{"error": "bad bootstrap room"}')
                return None

        def do_GET(self) -> None:
            room = self._room()
            if room is not None:
                delay = source.handoff_delay(room)
                if delay:
                    time.sleep(delay)
                body = source.handoff(room, self.headers.get(DECODE_SESSION_HEADER))
                self._reply(200, body) if body is not None else self._reply(404, b'{"error": "not staged"}')

        def do_DELETE(self) -> None:
            room = self._room()
            if room is not None:
                self._reply(200 if source.release(room) else 404, b"{}")

        def _reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler
