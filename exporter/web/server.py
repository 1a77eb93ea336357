"""A small HTTP/1.1 server on one asyncio thread, with TLS, basic auth and hard limits.

Why not ``prometheus_client.start_http_server``: its ``ThreadingHTTPServer`` spends a thread per
connection (no bound), a client that connects and sends nothing holds its thread until the socket
times out, and with TLS the handshake runs inside ``accept()`` so one silent client blocks every
other one (tooling.md §5). Here every connection is a coroutine:

* the listening socket is accepted by the loop itself; TLS is started per connection with the
  *current* certificate (so rotation needs no restart) and a handshake deadline;
* the request head must arrive within ``header_timeout`` (slowloris), be at most
  ``max_header_bytes`` (431) and carry a body of at most ``max_body_bytes`` (413);
* an idle keep-alive connection is closed after ``idle_timeout``; a client that does not read
  its response is dropped after ``write_timeout``;
* at most ``max_connections`` are open; when a new one arrives at the cap, the oldest connection
  that has not sent a request yet (silent, mid-handshake or idle) is closed to make room, so
  silent clients cannot starve real scrapes;
* bcrypt for basic auth runs in one worker thread (:class:`exporter.web.webconfig.Authenticator`).

A silent or slow client therefore costs a file descriptor, never a thread, and never delays
another scrape. Handlers are plain functions ``Request -> Response`` called on the loop thread;
they only read published snapshots, so they are quick.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

from exporter.web.webconfig import Active, WebConfigSource, parse_basic_auth, peer_matches_sans

__all__ = ["HttpServer", "Limits", "Request", "Response"]

log = logging.getLogger(__name__)

_TLS_HANDSHAKE_RECORD = 0x16


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
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


@dataclass(frozen=True)
class Limits:
    """Per-connection limits; sizes in bytes, times in seconds."""

    max_header_bytes: int = 16 * 1024  # request line + headers; larger -> 431
    max_body_bytes: int = 64 * 1024  # larger Content-Length -> 413
    header_timeout: float = 10.0  # a request head (and its body) must arrive within this
    idle_timeout: float = 60.0  # keep-alive connections idle longer are closed
    write_timeout: float = 30.0  # a client must take its response within this
    tls_handshake_timeout: float = 10.0
    max_connections: int = 256


class _Conn:
    __slots__ = ("task", "waiting", "since")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.waiting = True  # no request in progress: silent, in the handshake, or idle keep-alive
        self.since = time.monotonic()


class HttpServer:
    """Serve ``handler`` on ``(host, port)``.

    :param web_config: a loaded :class:`~exporter.web.webconfig.WebConfigSource` (TLS, basic auth,
        headers, rate limit), or None for plain HTTP without auth. Whether the server speaks TLS is
        decided at :meth:`start`; certificates, users and headers follow the file while serving.

    ``start()`` binds (raising ``OSError`` if it can't) and returns once the loop thread serves.
    """

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        web_config: WebConfigSource | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self._handler = handler
        self._host, self._port = host, port
        self._web = web_config
        self.limits = limits
        self._tls = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count()
        self._stopped: asyncio.Event | None = None
        self._warned_tls_off = False
        # Counters for tests and the exporter's own metrics.
        self.connections_total = 0
        self.connections_evicted_total = 0
        self.rejected_total: dict[int, int] = {}

    @property
    def port(self) -> int:
        assert self._sock is not None
        return self._sock.getsockname()[1]

    @property
    def tls(self) -> bool:
        return self._tls

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        if self._web is not None:
            self._tls = self._web.current().ssl_context is not None
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        if not self._host:
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        self._sock = socket.create_server(
            (self._host, self._port), family=family, backlog=128, reuse_port=False,
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
        self._stopped = asyncio.Event()
        accept = asyncio.ensure_future(self._accept_loop())
        ready.set()
        await self._stopped.wait()
        accept.cancel()
        # Cancel connections still open (idle keep-alives, silent clients) so the thread ends promptly.
        tasks = [c.task for c in self._conns.values() if c.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(accept, *tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                log.warning("accept failed: %s", exc.strerror or exc)
                await asyncio.sleep(0.1)
                continue
            self.connections_total += 1
            if len(self._conns) >= self.limits.max_connections and not self._evict_one():
                self._count(503)
                _refuse(conn)
                continue
            cid = next(self._ids)
            state = _Conn()
            self._conns[cid] = state
            state.task = loop.create_task(self._serve(cid, state, conn))

    def _evict_one(self) -> bool:
        """Close the oldest connection that is not in the middle of a request."""
        waiting = [(c.since, cid) for cid, c in self._conns.items() if c.waiting and c.task is not None]
        if not waiting:
            return False
        _, cid = min(waiting)
        conn = self._conns.pop(cid)
        assert conn.task is not None
        conn.task.cancel()
        self.connections_evicted_total += 1
        return True

    def _count(self, status: int) -> None:
        self.rejected_total[status] = self.rejected_total.get(status, 0) + 1

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
            if writer is not None:
                writer.close()
            else:
                conn.close()

    async def _open(self, conn: socket.socket) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self.limits.max_header_bytes, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        ctx = None
        if self._tls:
            deadline = self.limits.tls_handshake_timeout
            first = await asyncio.wait_for(_peek(conn), deadline)
            if not first:
                return None
            if first[0] != _TLS_HANDSHAKE_RECORD:
                # What Go's net/http answers to plain HTTP on a TLS port.
                body = b"Client sent an HTTP request to an HTTPS server.\n"
                _send_nowait(conn, b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                self._count(400)
                return None
            active = self._web.current() if self._web else None
            ctx = active.ssl_context if active else None
            if ctx is None:  # TLS was switched off in the file: a restart is needed to serve plain HTTP
                if not self._warned_tls_off:
                    log.error("web config no longer configures TLS; refusing TLS connections until restart")
                    self._warned_tls_off = True
                return None
            transport, _ = await asyncio.wait_for(
                loop.connect_accepted_socket(lambda: protocol, conn, ssl=ctx, ssl_handshake_timeout=deadline),
                deadline + 1.0,
            )
            allowed = active.config.tls.client_allowed_sans if active else None
            if allowed is not None:
                ssl_obj = transport.get_extra_info("ssl_object")
                if not peer_matches_sans(ssl_obj.getpeercert() if ssl_obj else None, allowed):
                    log.warning("client certificate has none of the allowed SANs; connection closed")
                    transport.close()
                    return None
        else:
            transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn)
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        return reader, writer

    async def _requests(self, state: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = True
        while True:
            state.waiting, state.since = True, time.monotonic()
            request, error = await self._read_request(reader, writer, first)
            first = False
            state.waiting = False
            if error is not None:
                if error.status:
                    self._count(error.status)
                    await self._send(writer, "GET", error, close=True)
                return
            assert request is not None
            response, request = await self._respond(request)
            close = _wants_close(request)
            await self._send(writer, request.method, response, close=close)
            if close:
                return

    async def _respond(self, request: Request) -> tuple[Response, Request]:
        active: Active | None = self._web.current() if self._web else None
        if active is None:
            return self._call(request), request
        extra = dict(active.config.headers)
        if active.error is not None:
            response = Response(500, b"Internal Server Error\n")
        elif not self._web.allow_request():
            response = Response(429, b"Too Many Requests\n")
        elif active.config.users:
            response, request = await self._authorize(active, request)
        else:
            response = self._call(request)
        if response.status in (401, 429, 500):
            self._count(response.status)
        response.headers.update(extra)  # also on 401/429/500, as exporter-toolkit does
        return response, request

    async def _authorize(self, active: Active, request: Request) -> tuple[Response, Request]:
        assert self._web is not None
        creds = parse_basic_auth(request.headers.get("authorization", ""))
        if creds is not None:
            verdict = await self._web.authenticator.check(active.config.users, *creds)
            if verdict is None:
                return Response(429, b"Too Many Requests\n", headers={"Retry-After": "1"}), request
            if verdict:
                request = dataclasses.replace(request, user=creds[0].decode("utf-8", "replace"))
                return self._call(request), request
        return Response(401, b"Unauthorized\n", headers={"WWW-Authenticate": "Basic"}), request

    def _call(self, request: Request) -> Response:
        try:
            return self._handler(request)
        except Exception:
            log.exception("handler failed for %s", request.path)
            return Response(500, b"internal error\n")

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool
    ) -> tuple[Request | None, Response | None]:
        limits = self.limits
        prefix = b""
        try:
            if not first:
                # Idle keep-alive: wait for the next request's first byte, then give its head the
                # normal header deadline (a keep-alive slowloris gets no more time than a new one).
                prefix = await asyncio.wait_for(reader.readexactly(1), limits.idle_timeout)
            head = prefix + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), limits.header_timeout)
        except asyncio.LimitOverrunError:
            return None, Response(431, b"request header too large\n")
        except ValueError:  # the separator was found beyond the limit
            return None, Response(431, b"request header too large\n")
        except (asyncio.IncompleteReadError, TimeoutError):
            return None, Response(0)  # closed or silent: just drop the connection
        if len(head) > limits.max_header_bytes:
            return None, Response(431, b"request header too large\n")
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
            if not version.startswith("HTTP/1.") or not method.isalpha() or not target:
                raise ValueError(version)
            headers: dict[str, str] = {}
            for line in lines[1:]:
                if not line:
                    continue
                name, sep, value = line.partition(":")
                if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
                    raise ValueError(line)
                key = name.lower()
                if key in headers and key in ("content-length", "host", "authorization"):
                    raise ValueError(f"duplicate {key}")  # request-smuggling and confusion guard
                headers[key] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return None, Response(400, b"bad request\n")
        if "transfer-encoding" in headers:
            return None, Response(501, b"transfer-encoding not supported\n")
        if length < 0 or length > limits.max_body_bytes:
            return None, Response(413, b"request body too large\n")
        body = b""
        if length:
            try:
                body = await asyncio.wait_for(reader.readexactly(length), limits.header_timeout)
            except (asyncio.IncompleteReadError, TimeoutError):
                return None, Response(0)
        url = urlsplit(target)
        ssl_obj = writer.get_extra_info("ssl_object")
        peer = writer.get_extra_info("peername")
        return (
            Request(
                method=method.upper(), path=url.path or "/", query=parse_qs(url.query), headers=headers, body=body,
                peer=str(peer[0]) if peer else "", tls_peer_cert=ssl_obj.getpeercert() if ssl_obj else None,
                version=version,
            ),
            None,
        )

    async def _send(self, writer: asyncio.StreamWriter, method: str, response: Response, close: bool) -> None:
        reason = HTTPStatus(response.status).phrase if response.status in HTTPStatus._value2member_map_ else ""
        headers = {
            "Content-Type": response.content_type,
            "Content-Length": str(len(response.body)),
            **response.headers,
        }
        if close:
            headers["Connection"] = "close"
        head = f"HTTP/1.1 {response.status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        if method != "HEAD" and response.body:
            writer.writelines((head.encode("latin-1"), response.body))
        else:
            writer.write(head.encode("latin-1"))
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout)


def _wants_close(request: Request) -> bool:
    connection = request.headers.get("connection", "").lower()
    if request.version == "HTTP/1.0":
        return "keep-alive" not in connection
    return "close" in connection


async def _peek(conn: socket.socket) -> bytes:
    """The first byte the client sends, without consuming it (b"" if it closed)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)
    try:
        return conn.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return await _peek(conn)


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
    _send_nowait(conn, b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n")
    conn.close()
