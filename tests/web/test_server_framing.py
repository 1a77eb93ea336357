"""Strict HTTP/1.1 framing: a malformed-request corpus answered as Go's net/http answers it.

The corpus: each case is raw bytes sent on a fresh connection, with the status our server must
answer and the status Go's net/http answers (measured against Debian's prometheus-node-exporter
1.5.0; when it is installed, the test re-measures it, so this table cannot drift from Go). Where
the two differ the case says why; every difference is ours being stricter or a limit of our own.

Sources for Go's behaviour: net/http's readRequest (request line, ``HTTP/x.y``, Host required in
HTTP/1.1 and validated by httpguts.ValidHostHeader), textproto's header reader (no space before
the colon, no control characters in values), and transfer.go (Content-Length is ``strconv.ParseUint``
of the trimmed value: digits only, so ``1_0``, ``+5``, ``-1``, ``0x5`` and ``5, 5`` are refused; two
identical headers are one; Transfer-Encoding other than chunked is 501).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from processes import node_exporter

from exporter.web.server import HttpServer, Limits, Request, Response

BODY = b"# HELP x test\n# TYPE x gauge\nx 1\n"


def handler(request: Request) -> Response:
    # Like promhttp: /metrics answers any method (the comparison is about framing, not routing).
    if request.path == "/metrics":
        return Response(200, BODY, "text/plain; version=0.0.4; charset=utf-8")
    return Response(404, b"not found\n")


H = b"Host: x\r\n"
# (id, request, our status, Go's status, why they differ)
CORPUS: list[tuple[str, bytes, int, int, str]] = [
    ("ok", b"GET /metrics HTTP/1.1\r\n" + H + b"\r\n", 200, 200, ""),
    ("http-1.0-without-host", b"GET /metrics HTTP/1.0\r\n\r\n", 200, 200, ""),
    ("http-1.1-without-host", b"GET /metrics HTTP/1.1\r\n\r\n", 400, 400, ""),
    ("two-hosts", b"GET /metrics HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, 400, ""),
    ("malformed-host", b"GET /metrics HTTP/1.1\r\nHost: a b\r\n\r\n", 400, 400, ""),
    ("content-length-underscore", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 1_0\r\n\r\n0123456789", 400, 400, ""),
    ("content-length-plus", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: +5\r\n\r\nabcde", 400, 400, ""),
    ("content-length-negative", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n", 400, 400, ""),
    ("content-length-word", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: x\r\n\r\n", 400, 400, ""),
    ("content-length-hex", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 0x5\r\n\r\nabcde", 400, 400, ""),
    ("content-length-list", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 5, 5\r\n\r\nabcde", 400, 400, ""),
    ("content-length-23-digits", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 99999999999999999999999\r\n\r\n",
     400, 400, ""),
    ("content-length-twice-same", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nabcde",
     200, 200, ""),
    ("content-length-twice-different",
     b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef", 400, 400, ""),
    ("content-length-padded", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length:  5 \r\n\r\nabcde", 200, 200, ""),
    ("body-over-64k", b"POST /metrics HTTP/1.1\r\n" + H + b"Content-Length: 70000\r\n\r\n" + b"a" * 70000, 413, 200,
     "our request body limit (64 KiB); node_exporter reads any body"),
    ("chunked", b"POST /metrics HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 200, 200, ""),
    ("chunked-and-length", b"POST /metrics HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
     200, 200, ""),
    ("transfer-encoding-gzip", b"POST /metrics HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip\r\n\r\n", 501, 501, ""),
    ("http-2.0", b"GET /metrics HTTP/2.0\r\n" + H + b"\r\n", 505, 505, ""),
    ("http-0.9", b"GET /metrics\r\n\r\n", 400, 400, ""),
    ("lower-case-http", b"GET /metrics http/1.1\r\n" + H + b"\r\n", 400, 400, ""),
    ("version-1.10", b"GET /metrics HTTP/1.10\r\n" + H + b"\r\n", 400, 400, ""),
    ("nul-in-method", b"G\x00T /metrics HTTP/1.1\r\n" + H + b"\r\n", 400, 400, ""),
    ("two-spaces", b"GET  /metrics HTTP/1.1\r\n" + H + b"\r\n", 400, 400, ""),
    ("space-in-target", b"GET /met rics HTTP/1.1\r\n" + H + b"\r\n", 400, 400, ""),
    ("target-without-slash", b"GET metrics HTTP/1.1\r\n" + H + b"\r\n", 400, 400, ""),
    ("absolute-target", b"GET http://x/metrics HTTP/1.1\r\n" + H + b"\r\n", 200, 200, ""),
    ("empty-line-first", b"\r\nGET /metrics HTTP/1.1\r\n" + H + b"\r\n", 400, 400, ""),
    ("bare-lf", b"GET /metrics HTTP/1.1\n" + H.replace(b"\r", b"") + b"\n", 200, 200, ""),
    ("header-without-colon", b"GET /metrics HTTP/1.1\r\n" + H + b"no colon here\r\n\r\n", 400, 400, ""),
    ("space-before-colon", b"GET /metrics HTTP/1.1\r\n" + H + b"X-A : b\r\n\r\n", 400, 400, ""),
    ("space-in-name", b"GET /metrics HTTP/1.1\r\n" + H + b"X A: b\r\n\r\n", 400, 400, ""),
    ("empty-name", b"GET /metrics HTTP/1.1\r\n" + H + b": b\r\n\r\n", 400, 200,
     "stricter: a header line without a name is not a header (RFC 9110 field-name is 1*tchar)"),
    ("folded-value", b"GET /metrics HTTP/1.1\r\n" + H + b"X-A: b\r\n c\r\n\r\n", 200, 200, ""),
    ("folded-first-line", b"GET /metrics HTTP/1.1\r\n X-A: b\r\n" + H + b"\r\n", 400, 400, ""),
    ("control-in-value", b"GET /metrics HTTP/1.1\r\n" + H + b"X-A: a\x01b\r\n\r\n", 400, 400, ""),
    ("nul-in-value", b"GET /metrics HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n", 400, 400, ""),
    ("obs-text-in-value", b"GET /metrics HTTP/1.1\r\n" + H + b"X-A: a\xffb\r\n\r\n", 200, 200, ""),
    ("lower-case-method", b"get /metrics HTTP/1.1\r\n" + H + b"\r\n", 200, 200, ""),
    ("tls-to-plain-port", b"\x16\x03\x01\x00\x05hello\r\n\r\n", 400, 400, ""),
    ("header-20k", b"GET /metrics HTTP/1.1\r\n" + H + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431, 200,
     "our header limit is 16 KiB; Go's default is 1 MiB"),
    ("header-2m", b"GET /metrics HTTP/1.1\r\n" + H + b"X-Big: " + b"a" * 2_000_000 + b"\r\n\r\n", 431, 431, ""),
    ("many-headers-no-host", b"GET /metrics HTTP/1.1\r\n" + b"X-Many: b\r\n" * 2000 + b"\r\n", 431, 400,
     "over our 16 KiB header limit, checked before anything else; Go (1 MiB) sees the missing Host"),
    ("options-asterisk", b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n", 404, 200,
     "Go's server answers OPTIONS * itself; here it is a path no route serves"),
    # Expect: the client waits for "100 Continue" before it sends the body (never sent here).
    ("expect-continue-body-withheld", b"GET /metrics HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n",
     200, 200, ""),
    ("expect-continue-chunked-withheld", b"POST /metrics HTTP/1.1\r\n" + H + b"Expect: 100-Continue\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", 200, 200, ""),
    ("expect-continue-body-sent", b"GET /metrics HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\nabcde",
     200, 200, ""),
    ("expect-continue-no-body", b"GET /metrics HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\n\r\n", 200, 200, ""),
    ("expect-other", b"GET /metrics HTTP/1.1\r\n" + H + b"Expect: something-else\r\n\r\n", 417, 417, ""),
    ("expect-continue-in-a-list-http-1.0", b"GET /metrics HTTP/1.0\r\nExpect: 100-continue, x\r\n\r\n", 200, 200, ""),
]


def status_of(port: int, data: bytes) -> int:
    """Send ``data`` on a fresh connection; the status code of the first response."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(data)
        except OSError:  # the server answered and closed before taking everything
            pass
        out = b""
        try:
            while b"\r\n" not in out and (chunk := s.recv(65536)):
                out += chunk
        except ConnectionResetError:
            pass
    assert out.startswith(b"HTTP/1."), out[:100]
    return int(out.split(b" ", 2)[1])


@contextlib.contextmanager
def ours() -> Iterator[HttpServer]:
    server = HttpServer(handler, "127.0.0.1", 0, limits=Limits())
    server.start()
    try:
        yield server
    finally:
        server.close()




def test_the_corpus_documents_every_difference() -> None:
    assert len({c[0] for c in CORPUS}) == len(CORPUS)
    for name, _, our, go, why in CORPUS:
        assert (our != go) == bool(why), name


def test_corpus_against_our_server() -> None:
    with ours() as server:
        got = {name: status_of(server.port, data) for name, data, *_ in CORPUS}
        assert status_of(server.port, CORPUS[0][1]) == 200  # and it still serves
    want = {name: our for name, _, our, _, _ in CORPUS}
    assert got == want


@pytest.mark.tools("prometheus-node-exporter")
def test_corpus_against_go_net_http() -> None:
    """The Go column is what Go's net/http answers (node_exporter serves with it)."""
    with node_exporter() as port:
        got = {name: status_of(port, data) for name, data, *_ in CORPUS}
    want = {name: go for name, _, _, go, _ in CORPUS}
    assert got == want


def test_responses_are_framed_as_before() -> None:
    """A well-formed request gets the same bytes as before h11 did the framing: status line,
    Content-Type, Content-Length, then the handler's headers, Connection: close when closing."""
    with ours() as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nHEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: %d\r\n" % len(BODY)
    assert out == head + b"\r\n" + BODY + head + b"Connection: close\r\n\r\n"


def _exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """Everything the server sends after ``data`` until it closes, and how long that took."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        started = time.monotonic()
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - started


def test_expect_100_continue_is_answered_at_once_as_go_answers_it() -> None:
    """A client that sends ``Expect: 100-continue`` waits for a go-ahead before its body. No route
    reads a body, so, as Go's net/http does for a handler that does not read it (promhttp), the
    answer comes at once, with no ``100 Continue``, and the connection is closed after it (its
    next bytes may be the withheld body). The same request without a body keeps the connection."""
    withheld = b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
    with ours() as server:
        out, took = _exchange(server.port, withheld)
        assert took < 2  # not the 10 s header deadline
        assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in out and out.endswith(BODY)
        assert b"100 Continue" not in out
        out, _ = _exchange(server.port, withheld + b"abcde" + b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.count(b"HTTP/1.1 200 OK") == 1  # closed after the first answer, as Go does
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n" * 2)
            out = b""
            while out.count(BODY) < 2 and (chunk := s.recv(65536)):
                out += chunk
            assert out.count(b"HTTP/1.1 200 OK") == 2 and b"Connection: close" not in out
        assert server.stats().rejected["malformed"] == 0
