"""The HTTP server over real sockets: limits, silent clients, TLS, mTLS, basic auth, reload, and the
same request matrix against Debian's node_exporter as the reference implementation."""

from __future__ import annotations

import base64
import contextlib
import http.client
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import wait_for
from pki import HASH, Pki, make_pki
from processes import NODE_EXPORTER, node_exporter

from exporter.web.server import HttpServer, Limits, Request, Response
from exporter.web.webconfig import WebConfigFile

PASSWORD_HASHES: dict[str, str] = {}
BODY = b"# HELP x test\n# TYPE x gauge\n" + b"".join(b'x{i="%d"} 1\n' % i for i in range(3000))  # ~50 KB


def bcrypt_hash(password: str, cost: int = 10) -> str:
    import bcrypt

    if password not in PASSWORD_HASHES:
        PASSWORD_HASHES[password] = bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()
    return PASSWORD_HASHES[password]


def handler(request: Request) -> Response:
    if request.path == "/metrics":
        return Response(200, BODY, "text/plain; version=0.0.4; charset=utf-8")
    if request.path == "/whoami":
        return Response(200, (request.user or "-").encode())
    return Response(404, b"not found\n")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.contextmanager
def serving(web_config: Path | None = None, limits: Limits | None = None, check_interval: float = 0) -> Iterator[HttpServer]:
    source = None
    if web_config is not None:
        source = WebConfigFile(web_config, check_interval=check_interval)
        source.load()
    server = HttpServer(handler, "127.0.0.1", 0, web_config=source, limits=limits or Limits())
    server.start()
    try:
        yield server
    finally:
        server.close()


def client_context(pki: Pki, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.path("ca.crt")))
    if cert:
        ctx.load_cert_chain(str(pki.path(f"{cert}.crt")), str(pki.path(f"{cert}.key")))
    return ctx


def get(port: int, path: str = "/metrics", *, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None,
        headers: dict | None = None, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10) if ctx
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    h = dict(headers or {})
    if auth:
        h["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        conn.request(method, path, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, return everything until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


# -- limits ---------------------------------------------------------------------------------------


def test_keep_alive_head_and_http10() -> None:
    with serving() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for _ in range(3):  # one connection, several requests
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            assert r.status == 200 and r.read() == BODY
        conn.request("HEAD", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Length") == str(len(BODY)) and r.read() == b""
        conn.close()
        out = raw(server.port, b"GET /metrics HTTP/1.0\r\n\r\n")  # HTTP/1.0: the server closes
        assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close" in out and out.endswith(BODY)
        assert raw(server.port, b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 404")


# Malformed and oversized requests: the corpus in test_server_framing.py, compared with Go's net/http.


def test_slowloris_is_closed_after_the_header_timeout() -> None:
    limits = Limits(header_timeout=0.5, idle_timeout=0.5)
    with serving(limits=limits) as server:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        started = time.monotonic()
        closed_after = None
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            for _ in range(40):  # one header byte every 50 ms, never finishing the head
                time.sleep(0.05)
                s.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
        finally:
            s.close()
        assert closed_after is not None and 0.4 < closed_after < 3.0, closed_after
        # A keep-alive connection gets the same deadline for its next head.
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(12) == b"HTTP/1.1 200"
            time.sleep(0.1)
            started = time.monotonic()
            s.sendall(b"G")
            s.settimeout(3)
            while s.recv(65536):
                pass
            assert time.monotonic() - started < 3.0
        finally:
            s.close()


def test_idle_keep_alive_is_closed() -> None:
    with serving(limits=Limits(idle_timeout=0.3)) as server:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        started = None
        while chunk := s.recv(65536):
            data += chunk
            if data.endswith(BODY) and started is None:
                started = time.monotonic()
        assert 0.2 < time.monotonic() - started < 3.0
        s.close()
        wait_for(lambda: server.open_connections == 0)


def test_a_full_house_of_silent_clients_makes_room_for_a_scrape() -> None:
    with serving(limits=Limits(max_connections=10)) as server:
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(30)]
        try:
            wait_for(lambda: server.open_connections == 10)
            for _ in range(5):
                assert get(server.port)[0] == 200
            assert server.stats().evicted >= 20
        finally:
            for s in silent:
                s.close()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_fifty_silent_clients_do_not_delay_scrapes(tls: bool, pki: Pki, tmp_path: Path) -> None:
    """50 clients open TCP (and for TLS never send a ClientHello) and hang; 100 scrapes on one
    keep-alive connection meanwhile keep their latency."""
    config = None
    if tls:
        config = tmp_path / "web.yml"
        config.write_text(f"tls_server_config:\n  cert_file: {pki.path('server.crt')}\n  key_file: {pki.path('server.key')}\n")
    ctx = client_context(pki) if tls else None
    with serving(config) as server:

        def scrape_latencies(n: int) -> list[float]:
            conn = (http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=5) if tls
                    else http.client.HTTPConnection("127.0.0.1", server.port, timeout=5))
            out = []
            try:
                for _ in range(n):
                    t = time.perf_counter()
                    conn.request("GET", "/metrics")
                    r = conn.getresponse()
                    assert r.status == 200 and len(r.read()) == len(BODY)
                    out.append((time.perf_counter() - t) * 1000)
            finally:
                conn.close()
            return out

        baseline = scrape_latencies(100)
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(50)]
        try:
            wait_for(lambda: server.open_connections >= 50)
            loaded = scrape_latencies(100)
            # New connections (a fresh handshake each) also get through.
            for _ in range(5):
                assert get(server.port, ctx=ctx)[0] == 200
        finally:
            for s in silent:
                s.close()
    p50, p99 = statistics.median(loaded), percentile(loaded, 99)
    print(f"\n{'tls' if tls else 'plain'}: scrape p50 {statistics.median(baseline):.2f} ms / p99 {percentile(baseline, 99):.2f} ms"
          f" idle; with 50 silent clients p50 {p50:.2f} ms / p99 {p99:.2f} ms")
    assert p99 < 100 and p50 < max(10, 3 * statistics.median(baseline))


# -- TLS ------------------------------------------------------------------------------------------


def _tls_config(tmp_path: Path, pki: Pki, extra: str = "", users: dict | None = None, headers: str = "") -> Path:
    for name in ("server.crt", "server.key", "ca.crt"):
        shutil.copy(pki.path(name), tmp_path / name)
    text = f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n{extra}"
    if headers:
        text += f"http_server_config:\n  headers:\n{headers}"
    if users:
        text += "basic_auth_users:\n" + "".join(f"  {u}: {h}\n" for u, h in users.items())
    path = tmp_path / "web.yml"
    path.write_text(text)
    return path


def _serial(port: int, ctx: ssl.SSLContext) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
        from cryptography import x509

        return x509.load_der_x509_certificate(t.getpeercert(binary_form=True)).serial_number


def _cert_serial(path: Path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def test_tls_serves_and_plain_http_gets_400(pki: Pki, tmp_path: Path) -> None:
    with serving(_tls_config(tmp_path, pki)) as server:
        assert server.tls
        status, _, body = get(server.port, ctx=client_context(pki))
        assert status == 200 and body == BODY
        out = raw(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert out.startswith(b"HTTP/1.0 400 Bad Request") and out.endswith(b"Client sent an HTTP request to an HTTPS server.\n")
        # An incomplete ClientHello is dropped at the handshake deadline, not held forever.
    with serving(_tls_config(tmp_path, pki), limits=Limits(tls_handshake_timeout=0.3)) as server:
        started = time.monotonic()
        assert raw(server.port, b"\x16\x03\x01\x02\x00\x01") == b""
        assert time.monotonic() - started < 3


def test_certificate_rotation_needs_no_restart(pki: Pki, tmp_path: Path) -> None:
    config = _tls_config(tmp_path, pki)
    with serving(config) as server:
        ctx = client_context(pki)
        assert _serial(server.port, ctx) == _cert_serial(pki.path("server.crt"))
        keep = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=5)
        keep.request("GET", "/metrics")
        assert keep.getresponse().read() == BODY
        # Rotate: the key first, then the cert (the moment in between must not break service).
        shutil.copy(pki.path("server2.key"), tmp_path / "server.key")
        assert get(server.port, ctx=ctx)[0] == 200  # old pair kept while the new one is half written
        shutil.copy(pki.path("server2.crt"), tmp_path / "server.crt")
        wait_for(lambda: _serial(server.port, ctx) == _cert_serial(pki.path("server2.crt")))
        assert get(server.port, ctx=ctx)[0] == 200
        keep.request("GET", "/metrics")  # an established connection keeps working
        assert keep.getresponse().read() == BODY
        keep.close()


def test_mtls_requires_a_certificate_from_the_client_ca(pki: Pki, tmp_path: Path) -> None:
    config = _tls_config(tmp_path, pki, "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n")
    with serving(config) as server:
        assert get(server.port, ctx=client_context(pki, "client"))[0] == 200
        for bad in (None, "rogue"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                get(server.port, ctx=client_context(pki, bad))
        assert get(server.port, ctx=client_context(pki, "other"))[0] == 200  # any cert from the CA


def test_client_allowed_sans(pki: Pki, tmp_path: Path) -> None:
    config = _tls_config(tmp_path, pki, "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n"
                                        "  client_allowed_sans: [prometheus.example]\n")
    with serving(config) as server:
        assert get(server.port, ctx=client_context(pki, "client"))[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            get(server.port, ctx=client_context(pki, "other"))


# -- basic auth -----------------------------------------------------------------------------------


def test_basic_auth_401_headers_cache_and_fake_hash(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n"
                      "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n    X-Frame-Options: deny\n")
    with serving(config) as server:
        auth = server._web.authenticator
        status, headers, _ = get(server.port)
        assert status == 401 and headers["www-authenticate"] == "Basic"
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "deny"
        assert get(server.port, auth=("prometheus", "wrong"))[0] == 401
        status, headers, body = get(server.port, "/whoami", auth=("prometheus", "s3cret"))
        assert status == 200 and body == b"prometheus" and headers["x-frame-options"] == "deny"
        runs = auth.bcrypt_runs
        for _ in range(5):  # cached: no further bcrypt
            assert get(server.port, auth=("prometheus", "s3cret"))[0] == 200
        assert auth.bcrypt_runs == runs
        assert get(server.port, auth=("nobody", "s3cret"))[0] == 401
        assert auth.bcrypt_runs == runs + 1  # unknown user: checked against the fake hash all the same
        assert get(server.port, auth=("nobody", "fakepassword"))[0] == 401  # the fake hash's password
        assert get(server.port, auth=("prometheus", "x" * 100))[0] == 401  # over bcrypt's 72 bytes
        assert get(server.port, headers={"Authorization": "Basic !!!"})[0] == 401
        assert raw(server.port, b"GET / HTTP/1.1\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n").startswith(b"HTTP/1.1 400")


def test_bcrypt_never_blocks_the_loop(tmp_path: Path) -> None:
    """Eight uncached wrong passwords need ~0.5 s of serial bcrypt; a scrape with cached
    credentials and a 404 without auth-relevant work are answered meanwhile in milliseconds."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret')}\n")
    with serving(config) as server:
        assert get(server.port, auth=("prometheus", "s3cret"))[0] == 200  # now cached
        with ThreadPoolExecutor(8) as pool:
            started = time.monotonic()
            futures = [pool.submit(get, server.port, auth=("prometheus", f"guess{i}")) for i in range(8)]
            wait_for(lambda: server._web.authenticator._pending >= 2, interval=0.001)
            t = time.perf_counter()
            assert get(server.port, auth=("prometheus", "s3cret"))[0] == 200
            fast = time.perf_counter() - t
            assert all(f.result()[0] == 401 for f in futures)
            slow = time.monotonic() - started
        assert fast < 0.15 < 0.3 < slow, (fast, slow)  # a cached login never waits behind bcrypt


def test_a_password_guessing_flood_is_bounded(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret', cost=4)}\n")
    with serving(config) as server:
        server._web.authenticator.max_pending = 2
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda i: get(server.port, auth=("prometheus", f"g{i}"))[0], range(12)))
        assert set(codes) <= {401, 429} and 401 in codes


def test_rate_limit(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("rate_limit:\n  interval: 1h\n  burst: 2\nhttp_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    with serving(config) as server:
        codes = [get(server.port)[0] for _ in range(3)]
        assert codes == [200, 200, 429]
        assert get(server.port)[1]["x-frame-options"] == "deny"


def test_reload_users_and_fail_closed_while_broken(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("")
    with serving(config) as server:
        assert get(server.port)[0] == 200
        config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret', cost=4)}\n")
        assert get(server.port)[0] == 401
        assert get(server.port, auth=("prometheus", "s3cret"))[0] == 200
        config.write_text("basic_auth_users:\n  prometheus: plaintext\n")  # broken: nobody gets in
        assert get(server.port, auth=("prometheus", "s3cret"))[0] == 500
        assert get(server.port)[0] == 500
        config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret', cost=4)}\n")
        assert get(server.port, auth=("prometheus", "s3cret"))[0] == 200


def test_a_web_config_or_key_replaced_by_a_fifo_never_stalls_the_loop(pki: Pki, tmp_path: Path) -> None:
    """Reloads run on the serving loop. A FIFO nobody writes put in place of the web config (an
    open would wait for a writer) fails closed at once, each request answered 500 while other
    connections are served; a key replaced by one keeps the previous certificate. Both recover
    when the file is back."""
    config = _tls_config(tmp_path, pki)
    text = config.read_text()
    ctx = client_context(pki)
    with serving(config) as server:
        assert get(server.port, ctx=ctx)[0] == 200
        (tmp_path / "server.key").unlink()
        os.mkfifo(tmp_path / "server.key")
        started = time.monotonic()
        assert get(server.port, ctx=ctx)[0] == 200  # the previous pair, at once
        config.unlink()
        os.mkfifo(config)
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: get(server.port, ctx=ctx)[0], range(8)))
        assert codes == [500] * 8  # fail closed, every one answered
        assert time.monotonic() - started < 5  # nothing waited for a writer
        config.unlink()
        config.write_text(text)
        (tmp_path / "server.key").unlink()
        shutil.copy(pki.path("server.key"), tmp_path / "server.key")
        assert get(server.port, ctx=ctx)[0] == 200
    assert server._web.reload_failures_total >= 2


# -- conformance with node_exporter ---------------------------------------------------------------




def _outcome(port: int, ctx: ssl.SSLContext | None, auth: tuple[str, str] | None) -> tuple:
    try:
        status, headers, _ = get(port, "/metrics", ctx=ctx, auth=auth)
    except (ssl.SSLError, ConnectionError, http.client.RemoteDisconnected):
        return ("handshake failed",)
    return status, headers.get("www-authenticate"), headers.get("x-content-type-options")


@pytest.mark.tools("prometheus-node-exporter")
def test_same_answers_as_node_exporter(pki: Pki, tmp_path: Path) -> None:
    config = _tls_config(tmp_path, pki, "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n",
                         users={"prometheus": bcrypt_hash("s3cret", cost=4)},
                         headers="    X-Content-Type-Options: nosniff\n")
    matrix = {
        "no client cert": (client_context(pki), ("prometheus", "s3cret")),
        "rogue client cert": (client_context(pki, "rogue"), ("prometheus", "s3cret")),
        "no credentials": (client_context(pki, "client"), None),
        "wrong password": (client_context(pki, "client"), ("prometheus", "nope")),
        "unknown user": (client_context(pki, "client"), ("root", "s3cret")),
        "right password": (client_context(pki, "client"), ("prometheus", "s3cret")),
    }
    with node_exporter(config) as ne_port:
        reference = {name: _outcome(ne_port, *args) for name, args in matrix.items()}
        ne_plain = raw(ne_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    with serving(config) as server:
        ours = {name: _outcome(server.port, *args) for name, args in matrix.items()}
        our_plain = raw(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    print("\nnode_exporter:", reference, "\nours:", ours)
    assert ours == reference
    assert reference["no credentials"] == (401, "Basic", "nosniff") and reference["right password"][0] == 200
    assert ne_plain.split(b"\r\n")[0] == our_plain.split(b"\r\n")[0] == b"HTTP/1.0 400 Bad Request"
    assert ne_plain.endswith(b"Client sent an HTTP request to an HTTPS server.\n") and our_plain.endswith(
        b"Client sent an HTTP request to an HTTPS server.\n")


@pytest.mark.tools("prometheus-node-exporter")
def test_node_exporter_also_rejects_what_we_reject_at_startup(tmp_path: Path) -> None:
    """An unknown key stops both at startup (node_exporter exits non-zero; our loader raises)."""
    from exporter.web.webconfig import WebConfigError, load_web_config

    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  a: {HASH}\nunknown_key: 1\n")
    proc = subprocess.run([NODE_EXPORTER, f"--web.config.file={config}", "--web.listen-address=127.0.0.1:0",
                           "--collector.disable-defaults", "--collector.loadavg"], capture_output=True, text=True, timeout=20)
    assert proc.returncode != 0 and "unknown_key" in proc.stderr
    with pytest.raises(WebConfigError, match="unknown key 'unknown_key'"):
        load_web_config(config)


def test_no_threads_beyond_the_loop_and_one_bcrypt_worker(tmp_path: Path) -> None:
    import threading

    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash('s3cret', cost=4)}\n")
    before = threading.active_count()
    with serving(config) as server:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: get(server.port, auth=("prometheus", f"p{i}")), range(8)))
        assert threading.active_count() == before + 2  # "http" and "bcrypt_0"
    assert threading.active_count() == before


def test_handler_errors_are_500_and_logged(caplog) -> None:
    def boom(_: Request) -> Response:
        raise RuntimeError("boom")

    server = HttpServer(boom, "127.0.0.1", 0)
    server.start()
    try:
        assert get(server.port)[0] == 500
        assert any("handler failed" in r.getMessage() for r in caplog.records)
    finally:
        server.close()


def test_environment_is_untouched() -> None:
    assert "SSLKEYLOGFILE" not in os.environ  # a key log would defeat TLS in these tests


# -- through the command line ----------------------------------------------------------------------


def test_cli_web_config_errors_are_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    from exporter.cli import main

    config = tmp_path / "web.yml"
    for text, message in [("basic_auth_user:\n  a: b\n", "unknown key 'basic_auth_user'"),
                          ("basic_auth_users:\n  a: plaintext\n", "not a bcrypt hash"),
                          ("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n", "missing.crt")]:
        config.write_text(text)
        assert main(["--scratch.root", str(tmp_path), "--web.config.file", str(config), "--web.listen-address", "127.0.0.1:0",
                     "--telemetry.source", "none"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_cli_serves_tls_with_basic_auth(pki: Pki, tmp_path: Path) -> None:
    import re
    import sys

    config = _tls_config(tmp_path, pki, users={"prometheus": bcrypt_hash("s3cret", cost=4)},
                         headers="    X-Content-Type-Options: nosniff\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "--scratch.root", str(scratch), "--web.listen-address", "127.0.0.1:0",
                             "--telemetry.source", "none", "--web.config.file", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if m := re.search(r"serving on https?://\S+:(\d+)/metrics", line):
                port = int(m.group(1))
                break
        else:
            raise AssertionError("exporter did not start")
        ctx = client_context(pki)
        status, headers, _ = get(port, ctx=ctx)
        assert status == 401 and headers["www-authenticate"] == "Basic" and headers["x-content-type-options"] == "nosniff"
        assert get(port, ctx=ctx, auth=("prometheus", "s3cret"))[0] == 200
        assert raw(port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 400")
    finally:
        proc.send_signal(__import__("signal").SIGTERM)
        assert proc.wait(20) == 0
        proc.stderr.close()
