"""A small HTTP/1.1 server on one asyncio thread, with TLS, basic auth and hard limits.

HTTP/1.1 parsing and framing is h11's; this module is the connection manager around it. Why not
``prometheus_client.start_http_server`` or aiohttp: the first spends a thread per connection (no
bound) and runs the TLS handshake inside ``accept()`` (one silent client blocks every other
one); neither has per-connection deadlines, a connection cap that evicts silent clients,
or a budget for response bytes held for clients that do not read. Here:

* the listening socket (backlog 4096) is drained in batches by the loop itself. A new connection
  costs one file descriptor and an epoll registration until its first byte arrives: no task, no
  transport, no TLS state. One that sends nothing within ``first_byte_timeout`` is closed;
* at most ``max_connections`` are open. When a new one arrives at the cap, the oldest connection
  that has not sent a byte is closed to make room, else the oldest that is between requests
  (idle keep-alive, or a request head still arriving), else the one that has been writing its
  response the longest (a client that does not read), so neither a flood of silent connects nor
  one of clients that ask and never read can starve a real scraper;
* TLS is started per connection with the *current* certificate (rotation needs no restart) and a
  handshake deadline;
* a request head must arrive within ``header_timeout`` of its first byte (slowloris), be at most
  ``max_header_bytes`` (431) and carry a body of at most ``max_body_bytes`` (413); framing is strict
  and matches Go's net/http on the corpus in tests/web/test_server_framing.py;
* an idle keep-alive connection is closed after ``idle_timeout``; a response must be taken by the
  client within ``write_timeout`` or the connection is closed. Bodies go out in pieces of 16 KiB
  (doubling up to 64 KiB while the client takes them as fast as they are written), and a
  connection's transport buffers at most ~16 KiB more, so a client that does not read costs about
  one piece of user-space memory, never a copy of its response;
* routes marked ``offload=True`` (JSON documents, what-if placement) run on a small worker pool
  with a cap on requests in flight; over the cap they get 503 with ``Retry-After`` at once.
  ``/metrics`` is answered on the loop from bytes already rendered; after a change it renders on a
  thread of its own (``Route.cached``), so a render never holds up the loop (other scrapes, health
  checks) and is never queued behind an offloaded request. Everything else runs on the loop;
* the bodies of both (documents and expositions) count against ``max_held_bytes`` until written,
  each distinct body once however many clients it is being sent to (every scrape of one render
  gets the same bytes object from the collector). Past the budget, a new request whose body is not
  already held gets 503 with ``Retry-After`` at once (an exposition without being rendered);
* bcrypt for basic auth runs in one worker thread, fairly across client addresses
  (:class:`exporter.web.auth.Authenticator`); verified credentials are cached and never wait.

Every refusal is counted by reason, every eviction too; :meth:`HttpServer.stats` returns them with
the bytes held as a :class:`~exporter.metrics.server.ServerStats` (the reasons are listed there).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import h11

from exporter.metrics.server import REJECT_REASONS, ServerStats
from exporter.web.auth import parse_basic_auth
from exporter.web.tls import peer_matches_sans
from exporter.web.webconfig import Active, WebConfigFile

__all__ = ["HttpServer", "Limits", "Request", "Response", "Route", "Router"]

log = logging.getLogger(__name__)

_TLS_HANDSHAKE_RECORD = 0x16
_CHUNK = 64 * 1024  # bytes read per step, and the largest piece of a body written per step
_FIRST_PIECE = 16 * 1024  # the first piece of a body; also the transport's write high-water mark
_ACCEPT_BATCH = 64  # connections accepted per wake-up, so reads of accepted ones interleave
_SWEEP_INTERVAL = 0.25  # seconds between checks of silent connections' deadlines


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes = b""
    peer: str = ""
    tls_peer_cert: dict | None = None
    user: str | None = None  # the basic-auth user, when basic auth is on
    version: str = "HTTP/1.1"


@dataclass
class Response:
    status: int = 200
    body: bytes | memoryview = b""  # a read-only memoryview: a document shared with other responses, not copied
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


@dataclass(frozen=True)
class Route:
    """A handler and where it runs: on the serving loop (quick: it only reads published bytes) or,
    with ``offload=True``, on the worker pool (it builds a document and may take long).

    With ``cached``, the loop first asks it for an answer from bytes already rendered. When it has
    none (something changed since the last render, or a render is running), ``handler`` renders:
    an offloaded route's on the worker pool (a document asked for again), another's on the
    server's own render thread: never on the loop, never queued behind the worker pool's
    documents, never refused for their sake (``/metrics``).
    """

    handler: Handler
    offload: bool = False
    cached: Callable[[Request], Response | None] | None = None


class Router:
    """Path → :class:`Route`; GET and HEAD only. Calling it answers a request synchronously (tests,
    the CLI's one-shot commands); :class:`HttpServer` resolves the route first to know where it runs.
    A trailing slash is ignored (``/metrics/`` is ``/metrics``)."""

    def __init__(self, routes: Mapping[str, Route]) -> None:
        self.routes = routes

    def resolve(self, request: Request) -> Route:
        route = self.routes.get(request.path.rstrip("/") or "/")
        if route is None:
            return _NOT_FOUND
        if request.method not in ("GET", "HEAD"):
            return _NOT_ALLOWED
        return route

    def __call__(self, request: Request) -> Response:
        return self.resolve(request).handler(request)


_NOT_FOUND = Route(lambda _: Response(404, b"not found\n"))
_NOT_ALLOWED = Route(lambda _: Response(405, b"method not allowed\n", headers={"Allow": "GET, HEAD"}))


@dataclass(frozen=True)
class Limits:
    """Per-connection and global limits; sizes in bytes, times in seconds."""

    max_header_bytes: int = 16 * 1024  # request line + headers; larger -> 431
    max_body_bytes: int = 64 * 1024  # larger body -> 413
    first_byte_timeout: float = 5.0  # a new connection that sends nothing for this long is closed
    header_timeout: float = 10.0  # a request head (and its body) must arrive within this of its first byte
    idle_timeout: float = 60.0  # keep-alive connections idle longer are closed
    write_timeout: float = 30.0  # a client must take each response within this
    tls_handshake_timeout: float = 10.0
    max_connections: int = 256
    backlog: int = 4096  # the kernel caps it at net.core.somaxconn
    offload_workers: int = 1  # threads for offloaded routes (more only add GIL contention)
    max_offloaded: int = 4  # offloaded requests running or queued; more -> 503
    max_held_bytes: int = 32 * 1024 * 1024  # distinct response bodies not yet written; over -> 503


class _Conn:
    """A connection that has sent its first byte and is served by a task."""

    __slots__ = ("task", "waiting", "since", "writing")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.waiting = True  # no request in progress: in the handshake, idle, or its head still arriving
        self.since = time.monotonic()
        self.writing: float | None = None  # since when its response is being written (monotonic)


class _Error(Exception):
    """A request that is answered with ``status`` and then the connection closed (0: just closed).

    ``reason`` is what it counts as (:data:`~exporter.metrics.server.REJECT_REASONS`): by default
    the one of its status; None for a connection that just ends (the client closed, or idled out).
    """

    def __init__(self, status: int, body: bytes = b"", reason: str | None = "") -> None:
        super().__init__(status)
        self.status, self.body = status, body
        self.reason = _STATUS_REASONS.get(status, "malformed") if reason == "" else reason


# What an error answer counts as; any other (501: a transfer coding; 417: an expectation) is malformed too.
_STATUS_REASONS = {0: None, 400: "malformed", 413: "max_body_bytes", 431: "max_header_bytes", 505: "malformed"}


_BAD_REQUEST = b"bad request\n"
_CONTENT_LENGTH_LINE = re.compile(rb"^content-length[ \t]*:[ \t]*(.*?)[ \t]*\r?$", re.I | re.M)
_HOST = re.compile(r"[0-9A-Za-z!$%&'()*+,\-.:;=\[\]_~]*")  # Go's httpguts.ValidHostHeader
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters other than HTAB


class HttpServer:
    """Serve ``handler`` on ``(host, port)``.

    :param handler: a :class:`Router` (routes may be offloaded) or a plain function, which then
        runs on the loop for every request.
    :param web_config: a loaded :class:`~exporter.web.webconfig.WebConfigFile` (TLS, basic auth,
        headers, rate limit), or None for plain HTTP without auth. Whether the server speaks TLS is
        decided at :meth:`start`; certificates, users and headers follow the file while serving.

    ``start()`` binds (raising ``OSError`` if it can't) and returns once the loop thread serves.
    """

    def __init__(
        self,
        handler: Router | Handler,
        host: str,
        port: int,
        *,
        web_config: WebConfigFile | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self._router = handler if isinstance(handler, Router) else None
        self._handler = handler
        self._host, self._port = host, port
        self._web = web_config
        self.limits = limits
        self._tls = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        # Connections that have not sent a byte: cid -> (socket, accepted at), oldest first.
        self._silent: collections.OrderedDict[int, tuple[socket.socket, float]] = collections.OrderedDict()
        self._ids = itertools.count()
        self._stopped: asyncio.Event | None = None
        self._sweep_wanted: asyncio.Event | None = None  # set when a connection turns silent
        self._warned_tls_off = False
        self._pool: ThreadPoolExecutor | None = None
        self._renderer: ThreadPoolExecutor | None = None  # one thread: renders for Route.cached
        self._offloaded = 0  # offloaded requests running or queued
        # Response bodies being written, by id, oldest first. Each distinct body counts once in
        # _held (bytes); _held_documents is the offloaded routes' share, _dropping what is being
        # dropped to make room. _latest: the newest exposition body handed out, per form (its
        # content type and encoding: text or OpenMetrics, plain or gzip).
        self._writing: dict[int, _Writing] = {}
        self._held = 0
        self._held_documents = 0
        self._dropping = 0
        self._latest: dict[str, bytes] = {}
        # Counters, written on the loop thread only; the lock makes a snapshot (stats()) consistent.
        self.connections_total = 0
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._evicted = 0
        self._stats_lock = threading.Lock()

    @property
    def port(self) -> int:
        assert self._sock is not None
        return self._sock.getsockname()[1]

    @property
    def tls(self) -> bool:
        return self._tls

    @property
    def open_connections(self) -> int:
        return len(self._conns) + len(self._silent)

    @property
    def held_bytes(self) -> int:
        """Bytes of response bodies (documents and expositions) produced and not yet written, each
        distinct body once: what ``max_held_bytes`` bounds."""
        return self._held

    def stats(self) -> ServerStats:
        """Refusals by reason and evictions since start, and the bytes of document responses held
        now. Cheap (a copy of a few counters) and safe to call from any thread.

        The exposition bodies being written are left out of ``held_bytes`` here (they count against
        the budget all the same): the exposition shows these figures, so a figure that moved with
        every scrape being written would make each scrape a new render, and the next scrape a new
        body, instead of all of them sharing one."""
        with self._stats_lock:
            return ServerStats(rejected=dict(self._rejected), evicted=self._evicted, held_bytes=self._held_documents)

    def start(self) -> None:
        if self._web is not None:
            self._tls = self._web.current().ssl_context is not None
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        if not self._host:
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        self._sock = socket.create_server(
            (self._host, self._port), family=family, backlog=self.limits.backlog, reuse_port=False,
            dualstack_ipv6=not self._host and family == socket.AF_INET6,
        )
        self._sock.setblocking(False)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="http", daemon=True)
        self._thread.start()
        ready.wait()

    def close(self) -> None:
        if self._loop is not None and self._stopped is not None and self._thread is not None:
            try:
                self._loop.call_soon_threadsafe(self._stopped.set)
            except RuntimeError:  # loop already closed
                pass
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        for pool in (self._pool, self._renderer):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._renderer = None
        if self._sock is not None:
            self._sock.close()
        if self._web is not None:
            self._web.close()

    # -- loop ----------------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(ready))
        finally:
            loop.close()

    async def _main(self, ready: threading.Event) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._sweep_wanted = asyncio.Event()
        assert self._sock is not None
        loop.add_reader(self._sock.fileno(), self._accept)
        sweeper = loop.create_task(self._sweep())
        ready.set()
        await self._stopped.wait()
        loop.remove_reader(self._sock.fileno())
        sweeper.cancel()
        for cid in list(self._silent):
            self._drop_silent(cid)
        # Cancel connections still open (idle keep-alives, slow clients) so the thread ends promptly.
        tasks = [c.task for c in self._conns.values() if c.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(sweeper, *tasks, return_exceptions=True)

    def _accept(self) -> None:
        """Accept what the backlog holds, up to a batch; readiness brings us back for the rest."""
        loop = self._loop
        assert loop is not None and self._sock is not None and self._sweep_wanted is not None
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                log.warning("accept failed: %s", exc.strerror or exc)
                fd = self._sock.fileno()
                loop.remove_reader(fd)
                loop.call_later(0.1, loop.add_reader, fd, self._accept)
                return
            self.connections_total += 1
            if self.open_connections >= self.limits.max_connections and not self._evict_one():
                self._reject("max_connections")
                _refuse(conn)
                continue
            conn.setblocking(False)
            cid = next(self._ids)
            self._silent[cid] = (conn, time.monotonic())
            loop.add_reader(conn.fileno(), self._first_byte, cid)
            self._sweep_wanted.set()

    def _first_byte(self, cid: int) -> None:
        """A silent connection became readable: from now on a task serves it, unless what it has
        to read is its end (a flood's connect-and-close costs one peek, not a transport)."""
        entry = self._silent.get(cid)
        if entry is None:
            return
        conn = entry[0]
        try:
            closed = not conn.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return  # a spurious wake-up: still silent, still watched
        except OSError:  # reset by the peer
            closed = True
        del self._silent[cid]
        assert self._loop is not None
        self._loop.remove_reader(conn.fileno())
        if closed:
            conn.close()
            return
        state = _Conn()
        self._conns[cid] = state
        state.task = self._loop.create_task(self._serve(cid, state, conn))

    def _drop_silent(self, cid: int) -> None:
        conn, _ = self._silent.pop(cid)
        assert self._loop is not None
        self._loop.remove_reader(conn.fileno())
        conn.close()

    async def _sweep(self) -> None:
        """Close connections that stayed silent past ``first_byte_timeout`` (oldest first).

        It sleeps while no connection is silent: four wake-ups a second of an idle exporter cost
        ~0.1 % of a core, more than the scrapes it answers."""
        wanted = self._sweep_wanted
        assert wanted is not None
        while True:
            if not self._silent:
                wanted.clear()
                await wanted.wait()
            await asyncio.sleep(_SWEEP_INTERVAL)
            cutoff = time.monotonic() - self.limits.first_byte_timeout
            while self._silent:
                cid, (_, since) = next(iter(self._silent.items()))
                if since > cutoff:
                    break
                self._drop_silent(cid)
                self._reject("first_byte_timeout")

    def _evict_one(self) -> bool:
        """Close the oldest silent connection, else the oldest one not in the middle of a request,
        else the one whose client has been slowest to take its response (the longest in writing):
        clients that ask and never read must not keep a scraper out for the write deadline."""
        if self._silent:
            self._drop_silent(next(iter(self._silent)))
            self._evicted_one()
            return True
        waiting = [(c.since, cid) for cid, c in self._conns.items() if c.waiting and c.task is not None]
        if not waiting:
            waiting = [(c.writing, cid) for cid, c in self._conns.items() if c.writing is not None and c.task is not None]
        if not waiting:
            return False
        _, cid = min(waiting)
        conn = self._conns.pop(cid)
        assert conn.task is not None
        conn.task.cancel()
        self._evicted_one()
        return True

    def _evicted_one(self) -> None:
        with self._stats_lock:
            self._evicted += 1

    def _reject(self, reason: str) -> None:
        """Count a refusal; ``reason`` is one of REJECT_REASONS (a KeyError otherwise)."""
        with self._stats_lock:
            self._rejected[reason] += 1

    # -- one connection --------------------------------------------------------------------------

    async def _serve(self, cid: int, state: _Conn, conn: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            opened = await self._open(conn)
            if opened is None:
                return
            reader, writer = opened
            await self._requests(state, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError, OSError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("connection failed")
        finally:
            self._conns.pop(cid, None)
            if writer is None:
                conn.close()
            elif writer.transport.get_write_buffer_size():
                # Evicted, timed out or cancelled with bytes unsent: asyncio's close() would hold the
                # socket and the buffer until a client that does not read finally reads.
                writer.transport.abort()
            else:
                writer.close()

    async def _open(self, conn: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_CHUNK, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        if self._tls:
            transport = await self._start_tls(conn, protocol)
            if transport is None:
                return None
        else:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn)
        # Pause writing at one small piece buffered: a client that does not read holds ~16-32 KiB
        # here, not its whole response (a client that reads keeps this buffer empty).
        transport.set_write_buffer_limits(high=_FIRST_PIECE)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        return reader, writer

    async def _start_tls(self, conn: socket.socket, protocol: asyncio.Protocol) -> asyncio.Transport | None:
        """TLS with the certificate of the web config as it is now; None for a client that is
        refused (counted) or already gone."""
        try:
            first = conn.recv(1, socket.MSG_PEEK)  # readable: the first byte is there, or EOF
        except (BlockingIOError, InterruptedError):
            return None
        if not first:
            return None
        if first[0] != _TLS_HANDSHAKE_RECORD:
            # What Go's net/http answers to plain HTTP on a TLS port.
            body = b"Client sent an HTTP request to an HTTPS server.\n"
            _send_nowait(conn, b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            self._reject("plain_http")
            return None
        active = self._web.current() if self._web else None
        if active is None or active.ssl_context is None:
            # TLS was switched off in the file: a restart is needed to serve plain HTTP.
            if not self._warned_tls_off:
                log.error("web config no longer configures TLS; refusing TLS connections until restart")
                self._warned_tls_off = True
            self._reject("tls_disabled")
            return None
        transport = await self._handshake(conn, protocol, active.ssl_context)
        allowed = active.config.tls.client_allowed_sans
        if allowed is not None:
            ssl_obj = transport.get_extra_info("ssl_object")
            if not peer_matches_sans(ssl_obj.getpeercert() if ssl_obj else None, allowed):
                log.warning("client certificate has none of the allowed SANs; connection closed")
                # abort(), not close(): it leaves the selector at once, before _serve closes the
                # socket; a graceful TLS close would keep the closed fd registered until it ends,
                # and the next connection given that fd number could not be served.
                transport.abort()
                self._reject("client_allowed_sans")
                return None
        return transport

    async def _handshake(self, conn: socket.socket, protocol: asyncio.Protocol, ctx: ssl.SSLContext) -> asyncio.Transport:
        """The TLS handshake, within ``tls_handshake_timeout``; a failure is counted and raised."""
        loop = asyncio.get_running_loop()
        deadline = self.limits.tls_handshake_timeout
        started = loop.time()
        try:
            transport, _ = await asyncio.wait_for(
                loop.connect_accepted_socket(lambda: protocol, conn, ssl=ctx, ssl_handshake_timeout=deadline),
                deadline + 1.0,
            )
        except OSError:  # ssl.SSLError, ConnectionError (asyncio's own handshake timeout), TimeoutError
            self._reject("tls_handshake_timeout" if loop.time() - started >= deadline else "tls_handshake")
            raise
        return transport

    async def _requests(self, state: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        first = True
        while True:
            state.waiting, state.since = True, time.monotonic()
            try:
                request, close = await self._read_request(h, reader, writer, first)
            except _Error as error:
                if error.reason is not None:
                    self._reject(error.reason)
                if error.status:
                    response = Response(error.status, error.body)
                    await self._send(h, writer, "GET", response, close=True)
                    await _linger(reader, writer)
                return
            first = False
            state.waiting = False
            unread = h.their_state is h11.SEND_BODY  # a body it waits to send (Expect: 100-continue)
            response, request = await self._respond(request)
            close = close or unread or _wants_close(request)
            state.writing = time.monotonic()
            await self._send(h, writer, request.method, response, close=close)
            state.writing = None
            if unread:  # the body may still come: take it before closing, so the answer is not reset
                await _linger(reader, writer)
            if close or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
                return
            h.start_next_cycle()

    async def _read_request(self, h: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            first: bool) -> tuple[Request, bool]:
        """The next request, and whether the connection must close after its response.

        :raises _Error: a malformed request (answered, then closed) or a silent/closed client.
        """
        limits = self.limits
        loop = asyncio.get_running_loop()
        head = bytearray()  # the raw head, for the checks h11 does not make
        fed = 0
        if not first and not h.trailing_data[0]:
            # Idle keep-alive: wait for the next request's first byte, then give its head the
            # normal header deadline (a keep-alive slowloris gets no more time than a new one).
            data = await self._recv(reader, loop.time() + limits.idle_timeout, None)
            h.receive_data(data)
            head += data
            fed += len(data)
        deadline = loop.time() + limits.header_timeout
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    data = await self._recv(reader, deadline, "header_timeout")
                    h.receive_data(data)
                    if len(head) <= limits.max_header_bytes:
                        head += data
                    fed += len(data)
                    continue
                break
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            end = head.find(b"\r\n\r\n")
            if (len(head) if end < 0 else end + 4) > limits.max_header_bytes:
                status = 431  # too large, whatever else is wrong with it
            raise _Error(status, b"request header too large\n" if status == 431 else _BAD_REQUEST) from None
        if isinstance(event, h11.ConnectionClosed):
            raise _Error(0)
        assert isinstance(event, h11.Request), event
        # h11 reads a head that arrived in one piece whatever its size; the limit is ours.
        head_size = fed - len(h.trailing_data[0])
        if head_size > limits.max_header_bytes:
            raise _Error(431, b"request header too large\n")
        close = self._check(event, bytes(head[:head_size]))
        # Expect: 100-continue with a body: the client waits for a go-ahead before sending it. No
        # route reads a body, so, as Go's net/http does for a handler that does not read it, the
        # request is answered at once, without "100 Continue", and the connection closed after.
        body = b"" if _waits_to_send_body(event) else await self._read_body(h, reader, deadline)
        version = "HTTP/" + event.http_version.decode("ascii")
        target = event.target.decode("latin-1")
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key = name.decode("latin-1")
            if key in ("authorization",) and key in headers:
                raise _Error(400, _BAD_REQUEST)  # which one would count? refuse rather than guess
            headers[key] = value.decode("latin-1")
        url = urlsplit(target)
        ssl_obj = writer.get_extra_info("ssl_object")
        peer = writer.get_extra_info("peername")
        request = Request(
            method=event.method.decode("latin-1").upper(), path=url.path or "/", query=parse_qs(url.query),
            headers=headers, body=body, peer=str(peer[0]) if peer else "",
            tls_peer_cert=ssl_obj.getpeercert() if ssl_obj else None, version=version,
        )
        return request, close

    def _check(self, event: h11.Request, head: bytes) -> bool:
        """What Go's net/http refuses and h11 lets through; True if the connection must close after."""
        if not event.http_version.startswith(b"1."):
            raise _Error(505, b"unsupported protocol version\n")
        target = event.target
        if not (target.startswith(b"/") or target == b"*" or b"://" in target):
            raise _Error(400, _BAD_REQUEST)
        close = False
        for name, value in event.headers:
            if _CTL.search(value):
                raise _Error(400, _BAD_REQUEST)
            if name == b"host" and not _HOST.fullmatch(value.decode("latin-1")):
                raise _Error(400, _BAD_REQUEST)
            if name == b"transfer-encoding":
                close = True  # a body framed by chunks: answer it, but start no further request here
        for length in _CONTENT_LENGTH_LINE.findall(head):
            if not length.isdigit():  # h11 merges "5, 5" into 5; Go refuses it
                raise _Error(400, _BAD_REQUEST)
        expect = next((value for name, value in event.headers if name == b"expect"), None)
        if expect is not None and not _expects_continue(expect):
            raise _Error(417, b"")  # Go's answer to any other expectation (RFC 9110 §10.1.1)
        return close

    async def _read_body(self, h: h11.Connection, reader: asyncio.StreamReader, deadline: float) -> bytes:
        body = bytearray()
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    h.receive_data(await self._recv(reader, deadline, "header_timeout"))
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > self.limits.max_body_bytes:
                        raise _Error(413, b"request body too large\n")
                elif isinstance(event, h11.EndOfMessage):
                    return bytes(body)
                else:  # the client closed mid-body
                    raise _Error(0)
        except h11.RemoteProtocolError:
            raise _Error(400, _BAD_REQUEST) from None

    async def _recv(self, reader: asyncio.StreamReader, deadline: float, timeout_reason: str | None) -> bytes:
        """Bytes from the client by ``deadline`` (loop time); past it the connection is dropped,
        counted as ``timeout_reason`` (None: an idle keep-alive ends without a refusal)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await reader.read(_CHUNK)
        except TimeoutError:
            raise _Error(0, reason=timeout_reason) from None  # silent: just drop the connection

    async def _respond(self, request: Request) -> tuple[Response, Request]:
        active: Active | None = self._web.current() if self._web else None
        if active is None:
            return await self._call(request), request
        extra = dict(active.config.headers)
        if active.error is not None:
            self._reject("config_invalid")
            response = Response(500, b"Internal Server Error\n")
        elif not self._web.allow_request():
            self._reject("rate_limit")
            response = Response(429, b"Too Many Requests\n")
        elif active.config.users:
            response, request = await self._authorize(active, request)
        else:
            response = await self._call(request)
        response.headers.update(extra)  # also on 401/429/500, as exporter-toolkit does
        return response, request

    async def _authorize(self, active: Active, request: Request) -> tuple[Response, Request]:
        assert self._web is not None
        creds = parse_basic_auth(request.headers.get("authorization", ""))
        if creds is not None:
            verdict = await self._web.authenticator.check(active.config.users, *creds, peer=request.peer)
            if verdict is None:
                self._reject("auth_throttled")
                return Response(429, b"Too Many Requests\n", headers={"Retry-After": "1"}), request
            if verdict:
                request = dataclasses.replace(request, user=creds[0].decode("utf-8", "replace"))
                return await self._call(request), request
        self._reject("unauthorized")
        return Response(401, b"Unauthorized\n", headers={"WWW-Authenticate": "Basic"}), request

    async def _call(self, request: Request) -> Response:
        if self._router is None:
            return _run_handler(self._handler, request)
        route = self._router.resolve(request)
        if route.offload:
            if route.cached is not None and (response := _run_handler(route.cached, request)) is not None:
                return self._held_response(response, encoding=None)
            return await self._offload(route, request)
        if route.cached is not None:
            return await self._exposition(route, request)
        return _run_handler(route.handler, request)

    async def _exposition(self, route: Route, request: Request) -> Response:
        """``/metrics``: the body already rendered, else a render on the render thread; either way
        it counts against ``max_held_bytes`` (:meth:`_held_response`). When document responses
        alone fill the budget, the answer is a quick 503, before any render."""
        assert route.cached is not None
        response = _run_handler(route.cached, request)
        if response is None:
            if self._held_documents >= self.limits.max_held_bytes:
                self._reject("max_held_bytes")
                return _busy(_HELD_FULL)
            if self._renderer is None:
                self._renderer = ThreadPoolExecutor(1, thread_name_prefix="http-render")
            response = await asyncio.get_running_loop().run_in_executor(self._renderer, _run_handler, route.handler, request)
        if request.method == "HEAD" or response.status != 200:
            return response
        # Keyed by content type too: a text body never supersedes the OpenMetrics body of the same render.
        form = f'{response.content_type}|{response.headers.get("Content-Encoding", "")}'
        return self._held_response(response, encoding=form)

    async def _offload(self, route: Route, request: Request) -> Response:
        """Run a document route on the worker pool, or refuse it (503) when the pool's queue or the
        bytes held for slow readers are full."""
        limits = self.limits
        full = ("max_held_bytes" if self._held - self._dropping >= limits.max_held_bytes
                else "max_offloaded" if self._offloaded >= limits.max_offloaded else None)
        if full is not None:
            self._reject(full)
            return _busy()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(limits.offload_workers, thread_name_prefix="http-worker")
        self._offloaded += 1
        try:
            response = await asyncio.get_running_loop().run_in_executor(self._pool, _run_handler, route.handler, request)
        finally:
            self._offloaded -= 1
        return self._held_response(response, encoding=None)

    def _held_response(self, response: Response, encoding: str | None) -> Response:
        """``response`` marked to count against ``max_held_bytes`` while it is written, or a 503.

        A body already being written costs nothing more. A new one must fit: for an exposition
        (``encoding`` is its form, content type and Content-Encoding; None: a document), room is
        first made by dropping the clients still being sent an exposition that a newer one of the
        same form has superseded, oldest first (they are refused, as ``max_held_bytes``, and retry with the
        current one), so that clients which never read cannot keep scrapes out with bodies of
        renders long gone; what cannot be made room for is refused with 503."""
        body = response.body
        if id(body) not in self._writing:
            held = self._held - self._dropping
            over = held + len(body) - self.limits.max_held_bytes
            if held and over > 0 and (encoding is None or not self._drop_superseded(over, encoding, body)):
                self._reject("max_held_bytes")
                return _busy(_BUSY if encoding is None else _HELD_FULL)
        if encoding is not None:
            self._latest[encoding] = body  # what supersedes the earlier bodies of its form
        return _Held(response.status, body, response.content_type, response.headers, encoding)

    def _drop_superseded(self, need: int, encoding: str, newer: bytes) -> bool:
        """Drop the clients of superseded exposition bodies, oldest first, until ``need`` bytes are
        on their way out (they are released as the clients' tasks end, within this loop turn);
        False, dropping nobody, if that cannot free enough."""
        latest = {**self._latest, encoding: newer}
        superseded = [entry for entry in self._writing.values() if entry.encoding is not None and not entry.dropped
                      and entry.body is not latest.get(entry.encoding)]
        if sum(len(entry.body) for entry in superseded) < need:
            return False
        for entry in superseded:
            if need <= 0:
                break
            entry.dropped = True
            self._dropping += len(entry.body)
            need -= len(entry.body)
            for task in entry.tasks:
                task.cancel()
                self._reject("max_held_bytes")
        return True

    async def _send(self, h: h11.Connection, writer: asyncio.StreamWriter, method: str, response: Response,
                    close: bool) -> None:
        """Write a response; a client that does not take it within ``write_timeout`` is dropped
        (TimeoutError) and counted."""
        held = isinstance(response, _Held) and method != "HEAD"
        if held:
            self._hold(response)
        try:
            async with asyncio.timeout(self.limits.write_timeout):
                await _write(h, writer, method, response, close)
        except TimeoutError:
            self._reject("write_timeout")
            raise
        finally:
            if held:
                self._release(response)

    def _hold(self, response: _Held) -> None:
        task = asyncio.current_task()
        assert task is not None
        entry = self._writing.get(id(response.body))
        if entry is not None:
            entry.tasks.add(task)
            return
        self._writing[id(response.body)] = _Writing(response.body, response.encoding, {task})
        size = len(response.body)
        with self._stats_lock:
            self._held += size
            if response.encoding is None:
                self._held_documents += size

    def _release(self, response: _Held) -> None:
        entry = self._writing[id(response.body)]
        entry.tasks.discard(asyncio.current_task())
        if entry.tasks:
            return
        del self._writing[id(response.body)]
        size = len(response.body)
        if entry.dropped:
            self._dropping -= size
        if self._latest.get(response.encoding) is response.body:
            del self._latest[response.encoding]  # written to everyone: nothing left to supersede
        with self._stats_lock:
            self._held -= size
            if response.encoding is None:
                self._held_documents -= size


@dataclass(eq=False)
class _Writing:
    """A response body being written: to which connections (their tasks), and whether they are
    being dropped to make room (:meth:`HttpServer._drop_superseded`)."""

    body: bytes | memoryview
    encoding: str | None  # an exposition's form: content type and Content-Encoding; None: a document
    tasks: set[asyncio.Task]
    dropped: bool = False


async def _write(h: h11.Connection, writer: asyncio.StreamWriter, method: str, response: Response, close: bool) -> None:
    """Frame and write one response (only its head for HEAD), waiting while the client is slow to read."""
    body = response.body
    reason = HTTPStatus(response.status).phrase if response.status in HTTPStatus._value2member_map_ else ""
    headers = [("Content-Type", response.content_type), ("Content-Length", str(len(body))), *response.headers.items()]
    if close:
        headers.append(("Connection", "close"))
    try:
        writer.write(h.send(h11.Response(status_code=response.status, headers=headers, reason=reason)))
        if method != "HEAD":
            view = memoryview(body)
            offset, size = 0, _FIRST_PIECE
            while offset < len(body):
                for piece in h.send_with_data_passthrough(h11.Data(data=view[offset:offset + size])):
                    writer.write(piece)
                offset += size
                # What the socket did not take is copied into the transport's buffer: a client that
                # takes every piece at once gets larger ones (fewer steps), one that lags small ones.
                size = min(size * 2, _CHUNK) if not writer.transport.get_write_buffer_size() else _FIRST_PIECE
                await writer.drain()
        writer.write(h.send(h11.EndOfMessage()))
    except h11.LocalProtocolError:  # h11 refuses to frame it (never for our own responses)
        log.exception("cannot send a %d response", response.status)
        raise ConnectionError from None
    if close:
        writer.transport.set_write_buffer_limits(high=0)  # drain() now waits for every byte
    await writer.drain()


class _Held(Response):
    """A response whose body counts against ``max_held_bytes`` until written (once per distinct
    body). ``encoding``: an exposition's form (content type and Content-Encoding); None for an
    offloaded route's document, which :meth:`HttpServer.stats` shows."""

    def __init__(self, status: int, body: bytes | memoryview, content_type: str, headers: dict[str, str],
                 encoding: str | None) -> None:
        super().__init__(status, body, content_type, headers)
        self.encoding = encoding


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an error answer: send FIN, then read and discard what the client is still sending for a
    moment, so that closing does not reset the connection before the client read the answer (Go's
    net/http waits 500 ms the same way)."""
    if not writer.can_write_eof():
        return
    writer.write_eof()
    try:
        async with asyncio.timeout(0.5):
            for _ in range(64):  # at most 4 MiB
                if not await reader.read(_CHUNK):
                    return
    except (TimeoutError, ConnectionError, OSError):
        pass


def _run_handler(handler: Handler, request: Request) -> Response:
    try:
        return handler(request)
    except Exception:
        log.exception("handler failed for %s", request.path)
        return Response(500, b"internal error\n")


_BUSY = b"busy: too many document requests in progress, retry later\n"
_HELD_FULL = b"busy: too many responses not yet taken by their clients, retry later\n"


def _busy(message: bytes = _BUSY) -> Response:
    return Response(503, message, headers={"Retry-After": "1"})


def _expects_continue(expect: bytes) -> bool:
    """Whether an ``Expect`` value has the ``100-continue`` token (any case), as Go's hasToken."""
    return any(token.strip().lower() == b"100-continue" for token in expect.split(b","))


def _waits_to_send_body(event: h11.Request) -> bool:
    """An HTTP/1.1 request with ``Expect: 100-continue`` that announces a body (Go's condition:
    a Content-Length other than 0, or chunked)."""
    if event.http_version != b"1.1":
        return False
    expect = next((value for name, value in event.headers if name == b"expect"), None)
    if expect is None or not _expects_continue(expect):
        return False
    for name, value in event.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _wants_close(request: Request) -> bool:
    connection = request.headers.get("connection", "").lower()
    if request.version == "HTTP/1.0":
        return True  # h11 keeps no HTTP/1.0 connection alive
    return "close" in connection


def _send_nowait(conn: socket.socket, data: bytes) -> None:
    """Best effort on a fresh socket (its send buffer is empty); never blocks the loop. What the
    client already sent is read and discarded first, so closing does not turn into a reset that
    would destroy the answer before the client reads it."""
    try:
        conn.recv(65536)
    except OSError:
        pass
    try:
        conn.send(data)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _refuse(conn: socket.socket) -> None:
    conn.setblocking(False)
    _send_nowait(conn, b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n")
    conn.close()
