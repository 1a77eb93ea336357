"""The HTTP server's protection counters: each refusal provoked over real loopback sockets and read
back through ``HttpServer.stats()``, and the families they render to (``exporter/metrics/server.py``)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import bcrypt
import pytest
from helpers import wait_for
from pki import Pki, make_pki
from processes import require_tool
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.metrics.server import REJECT_REASONS, ServerStats, server_families
from exporter.web.server import HttpServer, Limits, Request, Response, Route, Router
from exporter.web.webconfig import WebConfigFile

METRICS = b"# HELP x test\n# TYPE x gauge\nx 1\n"
PASSWORD_HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()  # cost 4: ~1 ms a check


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.contextmanager
def serving(handler=None, limits: Limits | None = None, web_config: Path | None = None) -> Iterator[HttpServer]:
    source = None
    if web_config is not None:
        source = WebConfigFile(web_config, check_interval=0)
        source.load()
    server = HttpServer(handler or (lambda _: Response(200, METRICS)), "127.0.0.1", 0, limits=limits or Limits(),
                        web_config=source)
    server.start()
    try:
        yield server
    finally:
        server.close()


def get(port: int, path: str = "/metrics", *, auth: tuple[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def raw(port: int, data: bytes = b"", timeout: float = 5.0) -> bytes:
    """Send ``data`` (if any), return everything until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if data:
            s.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
        return out


def refused(server: HttpServer) -> dict[str, int]:
    """The reasons counted so far, without the zeros."""
    return {reason: n for reason, n in server.stats().rejected.items() if n}


def exposition(stats: ServerStats) -> str:
    registry = CollectorRegistry()

    class Part:
        def collect(self):
            return server_families(stats)

    registry.register(Part())
    return generate_latest(registry).decode()


# -- the snapshot and its families --------------------------------------------------------------------


def test_a_fresh_server_exports_every_reason_at_zero() -> None:
    with serving() as server:
        stats = server.stats()
    assert list(stats.rejected) == list(REJECT_REASONS) and not any(stats.rejected.values())
    assert (stats.evicted, stats.held_bytes) == (0, 0)
    families = {f.name: f for f in text_string_to_metric_families(exposition(stats))}
    assert set(families) == {"gpu_alloc_http_requests_rejected", "gpu_alloc_http_connections_evicted",
                             "gpu_alloc_http_held_bytes"}
    rejected = families["gpu_alloc_http_requests_rejected"]
    assert rejected.type == "counter"
    assert {s.labels["reason"]: s.value for s in rejected.samples if s.name.endswith("_total")} == dict.fromkeys(REJECT_REASONS, 0.0)
    assert [(s.name, s.value) for s in families["gpu_alloc_http_connections_evicted"].samples] == [
        ("gpu_alloc_http_connections_evicted_total", 0.0)]
    assert families["gpu_alloc_http_held_bytes"].type == "gauge"
    assert [s.value for s in families["gpu_alloc_http_held_bytes"].samples] == [0.0]


def test_the_snapshot_is_complete_immutable_and_checked() -> None:
    stats = ServerStats(rejected={"unauthorized": 3}, evicted=2, held_bytes=5)
    assert stats.rejected["unauthorized"] == 3 and stats.rejected["max_connections"] == 0
    assert list(stats.rejected) == list(REJECT_REASONS)
    with pytest.raises(TypeError):
        stats.rejected["unauthorized"] = 4  # type: ignore[index]
    with pytest.raises(AttributeError):
        stats.evicted = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown rejection reason.*: teapot"):
        ServerStats(rejected={"teapot": 1})
    with pytest.raises(ValueError, match="negative"):
        ServerStats(held_bytes=-1)
    text = exposition(stats)
    assert 'gpu_alloc_http_requests_rejected_total{reason="unauthorized"} 3.0' in text
    assert "gpu_alloc_http_connections_evicted_total 2.0" in text and "gpu_alloc_http_held_bytes 5.0" in text


def test_promtool_check_metrics_is_clean() -> None:
    promtool = require_tool("promtool")
    stats = ServerStats(rejected={"max_connections": 1, "malformed": 7}, evicted=4, held_bytes=1 << 20)
    result = subprocess.run([promtool, "check", "metrics"], input=exposition(stats), capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


# -- each refusal, provoked ---------------------------------------------------------------------------


def test_connections_are_evicted_at_the_cap_and_refused_when_none_can_be() -> None:
    release = threading.Event()

    def slow(_: Request) -> Response:
        assert release.wait(30)
        return Response(200, b"{}\n")

    router = Router({"/metrics": Route(lambda _: Response(200, METRICS)), "/slow": Route(slow, offload=True)})
    with serving(router, Limits(max_connections=2, max_offloaded=4)) as server:
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        try:
            wait_for(lambda: server.open_connections == 2)
            assert get(server.port) == 200  # the oldest silent connection made room
            assert server.stats().evicted == 1 and not refused(server)
        finally:
            for s in silent:
                s.close()
        wait_for(lambda: server.open_connections == 0)
        busy = []
        try:
            for _ in range(2):  # both places taken by requests in progress: nothing to evict
                busy.append(socket.create_connection(("127.0.0.1", server.port)))
                busy[-1].sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_for(lambda: server._offloaded == 2)
            assert raw(server.port).startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            assert refused(server) == {"max_connections": 1} and server.stats().evicted == 1
        finally:
            release.set()
            for s in busy:
                s.close()


def test_bytes_held_for_a_reader_that_does_not_read_refuse_documents_and_time_out() -> None:
    body = b"x" * (8 << 20)
    router = Router({"/big": Route(lambda _: Response(200, body), offload=True)})
    limits = Limits(max_held_bytes=1 << 20, write_timeout=1.0)
    with serving(router, limits) as server:
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window, never read
        try:
            stuck.connect(("127.0.0.1", server.port))
            stuck.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_for(lambda: server.stats().held_bytes == len(body))
            assert get(server.port, "/big") == 503  # the budget is spent on the reader that does not read
            assert refused(server) == {"max_held_bytes": 1}
            # Past the write deadline the reader is dropped and its bytes are no longer held.
            wait_for(lambda: server.stats().held_bytes == 0, timeout=10)
            assert refused(server) == {"max_held_bytes": 1, "write_timeout": 1}
        finally:
            stuck.close()


@pytest.mark.parametrize(("request_bytes", "status", "reason"), [
    (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", b"400", "malformed"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5, 5\r\n\r\nhello", b"400", "malformed"),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", b"505", "malformed"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n", b"431", "max_header_bytes"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n" + b"a" * 70000, b"413", "max_body_bytes"),
])
def test_malformed_and_oversized_requests_are_counted(request_bytes: bytes, status: bytes, reason: str) -> None:
    with serving() as server:
        assert raw(server.port, request_bytes).startswith(b"HTTP/1.1 " + status)
        wait_for(lambda: refused(server) == {reason: 1})


def test_silent_and_slow_clients_are_counted_but_an_idle_keep_alive_is_not() -> None:
    limits = Limits(first_byte_timeout=0.2, header_timeout=0.3, idle_timeout=0.3)
    with serving(limits=limits) as server:
        assert raw(server.port) == b""  # connects, says nothing: closed after the first-byte deadline
        assert raw(server.port, b"GET /metrics HTTP/1.1\r\n") == b""  # a head that never ends
        wait_for(lambda: refused(server) == {"first_byte_timeout": 1, "header_timeout": 1})
        out = raw(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then idles out
        assert out.startswith(b"HTTP/1.1 200") and out.endswith(METRICS)
        assert refused(server) == {"first_byte_timeout": 1, "header_timeout": 1}


def test_auth_failures_and_throttling_are_counted(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: {PASSWORD_HASH}\n")
    with serving(web_config=config) as server:
        assert get(server.port) == 401
        assert get(server.port, auth=("prometheus", "wrong")) == 401
        assert get(server.port, auth=("prometheus", "s3cret")) == 200
        assert refused(server) == {"unauthorized": 2}
        # Guesses from one address: beyond the checks it may have waiting, refused (429).
        auth = server._web.authenticator
        auth.max_pending_per_peer = 2
        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(lambda i: get(server.port, auth=("prometheus", f"guess{i}")), range(12)))
        throttled = statuses.count(429)
        assert throttled >= 1 and set(statuses) == {401, 429}
        assert refused(server) == {"unauthorized": 2 + statuses.count(401), "auth_throttled": throttled}


def test_the_rate_limit_and_a_broken_config_are_counted(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("rate_limit:\n  interval: 1h\n  burst: 1\n")
    with serving(web_config=config) as server:
        assert [get(server.port), get(server.port)] == [200, 429]
        assert refused(server) == {"rate_limit": 1}
        config.write_text("rate_limit:\n  interval: soon\n")  # invalid now: every request fails closed
        assert get(server.port) == 500
        assert refused(server) == {"rate_limit": 1, "config_invalid": 1}


def test_tls_refusals_are_counted(pki: Pki, tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {pki.path('server.crt')}\n  key_file: {pki.path('server.key')}\n"
                      f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.path('ca.crt')}\n"
                      "  client_allowed_sans: [prometheus.example]\n")

    def handshake(cert: str | None) -> None:
        ctx = ssl.create_default_context(cafile=str(pki.path("ca.crt")))
        if cert:
            ctx.load_cert_chain(str(pki.path(f"{cert}.crt")), str(pki.path(f"{cert}.key")))
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s, \
                ctx.wrap_socket(s, server_hostname="localhost") as tls:
            tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert tls.recv(12) == b"HTTP/1.1 200"

    with serving(web_config=config, limits=Limits(tls_handshake_timeout=0.3)) as server:
        handshake("client")
        assert raw(server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.0 400 Bad Request")
        for cert in ("rogue", "other"):  # another CA's certificate; this CA's, without the allowed SAN
            with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
                handshake(cert)
        assert raw(server.port, b"\x16") == b""  # a handshake that never goes on
        wait_for(lambda: refused(server) == {"plain_http": 1, "tls_handshake": 1, "client_allowed_sans": 1,
                                             "tls_handshake_timeout": 1}, timeout=10)
