"""Docker labels → Identity: the list endpoint over a real unix socket (a server that answers as
the Docker Engine API does), only that endpoint, bounded answers, and one-line errors."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker_fake import FakeDocker, container

from exporter.scratch.containers import ContainerListError, DockerLabels, parse_container_list
from exporter.scratch.identity import UNDEFINED, Identity

KID = "3f6c2b1e-8a4d-4c2e-9b7a-1d2e3f4a5b6c"
SID = "b0a4e7c2-5d1f-4e6a-8c3b-2f9d7e1a6b4c"
UID = "f38dea23-50fa-42a0-b5ae-338f5f4693f4"




@pytest.fixture
def docker(tmp_path: Path) -> Iterator[FakeDocker]:
    fake = FakeDocker(tmp_path / "docker.sock", [container(KID, SID)])
    yield fake
    fake.close()


def test_the_labels_of_kernel_containers_give_their_identity(docker: FakeDocker) -> None:
    other = {"Id": "f" * 64, "Labels": {"com.docker.compose.project": "monitoring"}}
    docker.containers += [container("9e1d7c3a-2b4f-4a6e-8d5c-7f0a1b2c3d4e", "4c8e2a6f-1b3d-4f5a-9e7c-0d2b4f6a8c1e", None), other]
    got = DockerLabels(str(docker.path)).fetch()
    assert got[KID] == Identity(KID, SID, UID, UNDEFINED, "i-gpu-node01", "interactive")
    assert got["9e1d7c3a-2b4f-4a6e-8d5c-7f0a1b2c3d4e"].user_id == UNDEFINED
    assert len(got) == 2


def test_only_the_list_endpoint_is_asked_never_inspect(docker: FakeDocker) -> None:
    DockerLabels(str(docker.path)).fetch()
    assert len(docker.requests) == 1
    url = urllib.parse.urlsplit(docker.requests[0])
    assert url.path == "/containers/json"  # never /containers/{id}/json, which returns the environment
    assert json.loads(urllib.parse.parse_qs(url.query)["filters"][0]) == {"label": ["ai.backend.kernel-id"]}


def test_label_values_are_checked_and_spelled_as_backendai_spells_them() -> None:
    text = json.dumps([container(KID.upper(), SID, "not-a-uuid", **{"ai.backend.agent-id": "bad id\n"}),
                       container("x", SID), {"Labels": None}, "junk", {"Labels": {"ai.backend.kernel-id": 5}}])
    assert parse_container_list(text) == {KID: Identity(KID, SID, UNDEFINED, UNDEFINED, UNDEFINED, "interactive")}


@pytest.mark.parametrize("text", ["", "{}", "[", "null", "{" * 100_000])
def test_an_answer_that_is_not_a_list_is_an_error(text: str) -> None:
    with pytest.raises(ContainerListError):
        parse_container_list(text)


def test_a_missing_socket_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ContainerListError, match=r"^/.*/absent\.sock: no socket there$"):
        DockerLabels(str(tmp_path / "absent.sock")).fetch()


def test_a_socket_nobody_listens_on(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: connect is refused
        with pytest.raises(ContainerListError, match="nothing listens on it"):
            DockerLabels(str(path)).fetch()


@pytest.mark.parametrize(("status", "body", "reason"), [
    (500, b'{"message":"boom"}', "the daemon answered HTTP 500"),
    (200, b"<html>", "the container list is not JSON"),
    (200, b"\xff\xfe[]", "the container list is not UTF-8"),
])
def test_a_bad_answer_is_one_line_without_its_content(docker: FakeDocker, status: int, body: bytes, reason: str) -> None:
    docker.status, docker.body = status, body
    with pytest.raises(ContainerListError) as caught:
        DockerLabels(str(docker.path)).fetch()
    assert str(caught.value) == f"{docker.path}: {reason}"


def test_an_answer_over_the_limit_is_refused(docker: FakeDocker) -> None:
    docker.containers *= 50
    with pytest.raises(ContainerListError, match="over 4096 bytes"):
        DockerLabels(str(docker.path), max_bytes=4096).fetch()


def test_a_daemon_that_drips_its_answer_is_cut_at_the_deadline(docker: FakeDocker) -> None:
    docker.containers *= 4
    docker.drip = 0.05  # 64 bytes every 50 ms: several seconds for the whole list
    started = time.monotonic()
    with pytest.raises(ContainerListError, match="within 0.3 s"):
        DockerLabels(str(docker.path), timeout=0.3).fetch()
    assert time.monotonic() - started < 2


class DrippingDaemon:
    """A unix socket that answers every connection with ``head`` at once and then ``drip``, one
    byte every ``interval`` seconds, until the client goes away (a daemon that is wedged, or a
    hostile one, never finishing its answer)."""

    def __init__(self, path: Path, head: bytes, drip: bytes, interval: float) -> None:
        self.head, self.drip, self.interval = head, drip, interval
        self.stop = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.listener.settimeout(0.05)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)  # the request
                try:
                    conn.sendall(self.head)
                    for byte in itertools.cycle(self.drip):
                        if self.stop.wait(self.interval):
                            return
                        conn.sendall(bytes([byte]))
                except OSError:  # the client gave up
                    continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize(("head", "drip"), [
    (b"HTTP/1.1 200 OK\r\n", b"Content-Type: application/json\r\n"),  # one header byte every 0.1 s
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"00000000000000"),  # a chunk-size line
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n[]\r\n", b"                  "),  # a body
], ids=["headers", "chunk-size-line", "chunked-body"])
def test_one_deadline_covers_the_whole_answer_however_it_drips(tmp_path: Path, head: bytes, drip: bytes) -> None:
    """Every byte arrives well within any per-receive timeout, yet the request ends at its one
    deadline, with the one-line error the app turns into collector_success 0."""
    daemon = DrippingDaemon(tmp_path / "docker.sock", head, drip, interval=0.1)
    try:
        started = time.monotonic()
        with pytest.raises(ContainerListError) as caught:
            DockerLabels(str(tmp_path / "docker.sock"), timeout=0.5).fetch()
        took = time.monotonic() - started
    finally:
        daemon.close()
    assert str(caught.value) == f"{tmp_path / 'docker.sock'}: no complete answer within 0.5 s"
    assert 0.45 <= took < 1.5, took
