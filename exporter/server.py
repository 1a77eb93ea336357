"""A small HTTP/1.1 server on one asyncio thread.

Why not ``prometheus_client.start_http_server``: its ``ThreadingHTTPServer`` spends a thread per
connection (no bound), and a client that connects and sends nothing holds its thread until the
socket times out. Here every connection is a coroutine with header, body and idle deadlines, a
connection cap, and a request-size cap, so a silent or slow client costs a file descriptor, not a
thread, and never delays another scrape. TLS handshakes run on the same loop with their own
deadline.

Handlers are plain functions ``Request -> Response`` called on the loop thread; they only read
published snapshots, so they are quick.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

__all__ = ["HttpServer", "Limits", "Request", "Response"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes = b""
    peer: str = ""
    tls_peer_cert: dict | None = None


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

    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 64 * 1024
    header_timeout: float = 10.0  # a client must send its request head within this
    idle_timeout: float = 60.0  # keep-alive connections idle longer are closed
    tls_handshake_timeout: float = 10.0
    max_connections: int = 256


class HttpServer:
    """Serve ``handler`` on ``(host, port)``; ``start()`` binds (raising ``OSError`` if it can't) and
    returns once the loop thread serves."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        ssl_context: Callable[[], ssl.SSLContext | None] | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self._handler = handler
        self._host, self._port = host, port
        self._ssl_context = ssl_context
        self.limits = limits
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._connections = 0
        self._stopped: asyncio.Event | None = None

    @property
    def port(self) -> int:
        assert self._sock is not None
        return self._sock.getsockname()[1]

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        if not self._host:
            family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        self._sock = socket.create_server(
            (self._host, self._port), family=family, backlog=128, reuse_port=False,
            dualstack_ipv6=not self._host and family == socket.AF_INET6,
        )
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="http", daemon=True)
        self._thread.start()
        ready.wait()

    def close(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join()
        self._thread = None

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(ready))
        finally:
            loop.close()

    async def _main(self, ready: threading.Event) -> None:
        self._stopped = asyncio.Event()
        server = await asyncio.start_server(
            self._connection, sock=self._sock, limit=self.limits.max_header_bytes,
            ssl=self._ssl_context() if self._ssl_context else None,
            ssl_handshake_timeout=self.limits.tls_handshake_timeout if self._ssl_context else None,
        )
        ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
        # Cancel connections still open (idle keep-alives) so the thread ends promptly.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        try:
            if self._connections > self.limits.max_connections:
                await self._send(writer, "GET", Response(503, b"too many connections\n"), close=True)
                return
            first = True
            while True:
                timeout = self.limits.header_timeout if first else self.limits.idle_timeout
                request, error = await self._read_request(reader, writer, timeout)
                first = False
                if error is not None:
                    if error.status:
                        await self._send(writer, "GET", error, close=True)
                    return
                assert request is not None
                try:
                    response = self._handler(request)
                except Exception:
                    log.exception("handler failed for %s", request.path)
                    response = Response(500, b"internal error\n")
                close = request.headers.get("connection", "").lower() == "close"
                await self._send(writer, request.method, response, close=close)
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
            pass
        finally:
            self._connections -= 1
            writer.close()

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float
    ) -> tuple[Request | None, Response | None]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.LimitOverrunError:
            return None, Response(431, b"request header too large\n")
        except (asyncio.IncompleteReadError, TimeoutError):
            return None, Response(0)  # closed or silent: just drop the connection
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
            if not version.startswith("HTTP/1."):
                raise ValueError(version)
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return None, Response(400, b"bad request\n")
        if length < 0 or length > self.limits.max_body_bytes or "transfer-encoding" in headers:
            return None, Response(413, b"request body too large\n")
        body = b""
        if length:
            try:
                body = await asyncio.wait_for(reader.readexactly(length), self.limits.header_timeout)
            except (asyncio.IncompleteReadError, TimeoutError):
                return None, Response(0)
        url = urlsplit(target)
        ssl_obj = writer.get_extra_info("ssl_object")
        peer = writer.get_extra_info("peername")
        return (
            Request(
                method=method.upper(), path=url.path or "/", query=parse_qs(url.query), headers=headers, body=body,
                peer=str(peer[0]) if peer else "", tls_peer_cert=ssl_obj.getpeercert() if ssl_obj else None,
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
        writer.write(head.encode("latin-1"))
        if method != "HEAD":
            writer.write(response.body)
        await asyncio.wait_for(writer.drain(), self.limits.idle_timeout)
