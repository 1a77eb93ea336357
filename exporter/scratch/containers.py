"""Kernel identity from the Docker labels the agent puts on every kernel container (opt-in).

Agents before 25.18 write no ``config/recovery.json``, so their kernels' session and owner are
unknown to the scratch tree. The agent labels every kernel container with ``ai.backend.kernel-id``,
``ai.backend.session-id``, ``ai.backend.owner-user-id``, ``ai.backend.agent-id`` and
``ai.backend.session-type``; one ``GET /containers/json`` with a label filter lists them all.

That list endpoint answers each container's labels and never its environment. Inspecting a
container (``/containers/{id}/json``) would return its environment, which holds the user's
secrets, so this module never calls it, nor anything else. Access to the Docker socket is
root-equivalent, so the reader is off unless ``--identity.docker-socket`` names the socket.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse

from exporter.scratch.identity import DOCKER_LABELS, Identity, identity_from_labels

__all__ = ["DEFAULT_MAX_BYTES", "ContainerListError", "DockerLabels", "parse_container_list"]

# Each container's entry holds its labels, ports and mounts: 8 MiB is far beyond the list of what
# one agent node runs, and bounds what a broken daemon can make us hold.
DEFAULT_MAX_BYTES = 8 << 20
# Only the agent's kernel containers: the daemon filters, so other containers never reach us.
_QUERY = "/containers/json?" + urllib.parse.urlencode({"filters": json.dumps({"label": [DOCKER_LABELS["kernel_id"]]})})


class ContainerListError(Exception):
    """The container list could not be read; ``str()`` is one line naming the socket and the reason."""


def parse_container_list(text: str) -> dict[str, Identity]:
    """Identities by kernel id from the text of a ``GET /containers/json`` answer.

    Containers whose labels name no kernel and session are skipped; values are checked and
    spelled as in :func:`~exporter.scratch.identity.identity_from_labels`.

    :raises ContainerListError: the text is not a JSON list of containers.
    """
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise ContainerListError("the container list is not JSON") from None
    if not isinstance(doc, list):
        raise ContainerListError("the container list is not a JSON list")
    out: dict[str, Identity] = {}
    for container in doc:
        labels = container.get("Labels") if isinstance(container, dict) else None
        if not isinstance(labels, dict):
            continue
        identity = identity_from_labels({k: v for k, v in labels.items() if isinstance(v, str)})
        if identity is not None:
            out[identity.kernel_id] = identity
    return out


class _DeadlineSocket(socket.socket):
    """A socket whose every send and receive gives up at one deadline (``time.monotonic()``), not
    after a timeout of its own: http.client reads the status line, each header line and each
    chunk-size line with separate receives, so a per-call timeout lets a daemon that sends a byte
    now and then hold a request for ever."""

    deadline = 0.0

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.settimeout(left)

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:  # what socket.makefile() reads with
        self._arm()
        return super().recv_into(buffer, nbytes, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._arm()
        return super().recv(bufsize, flags)

    def sendall(self, data, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the daemon's unix socket (the Host header is a formality there), every byte
    of it within ``deadline`` (``time.monotonic()``)."""

    def __init__(self, path: str, deadline: float) -> None:
        super().__init__("localhost", timeout=max(0.0, deadline - time.monotonic()))
        self._path = path
        self._deadline = deadline

    def connect(self) -> None:
        sock = _DeadlineSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.deadline = self._deadline
        try:
            sock._arm()
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class DockerLabels:
    """Reads the kernel containers' identity labels from a Docker-compatible API socket.

    :param socket_path: the daemon's socket, e.g. ``/var/run/docker.sock``.
    :param timeout: seconds for the whole request, connect to last byte: one deadline that every
        step (connect, send, status line, each header and chunk-size line, the body) must meet.
    :param max_bytes: the largest answer read; a bigger one is an error, not a truncation.
    """

    def __init__(self, socket_path: str, timeout: float = 2.0, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.max_bytes = max_bytes

    def fetch(self) -> dict[str, Identity]:
        """Identities by kernel id of the running kernel containers.

        :raises ContainerListError: one line naming the socket and why it could not be read.
        """
        deadline = time.monotonic() + self.timeout
        conn = _UnixConnection(self.socket_path, deadline)
        try:
            conn.request("GET", _QUERY, headers={"Accept": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise self._error(f"the daemon answered HTTP {response.status}")
            body = bytearray()
            while len(body) <= self.max_bytes:
                chunk = response.read1(65536)
                if not chunk:
                    break
                body += chunk
            if len(body) > self.max_bytes:
                raise self._error(f"the answer is over {self.max_bytes} bytes")
        except FileNotFoundError:
            raise self._error("no socket there") from None
        except PermissionError:
            raise self._error("permission denied (the socket needs root or the docker group)") from None
        except ConnectionRefusedError:
            raise self._error("nothing listens on it") from None
        except TimeoutError:
            raise self._error(f"no complete answer within {self.timeout:g} s") from None
        except (http.client.HTTPException, ConnectionError):
            raise self._error("not an HTTP answer") from None
        except OSError as exc:
            raise self._error(exc.strerror or "cannot connect") from None
        finally:
            conn.close()
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise self._error("the container list is not UTF-8") from None
        try:
            return parse_container_list(text)
        except ContainerListError as exc:
            raise self._error(str(exc)) from None

    def _error(self, reason: str) -> ContainerListError:
        return ContainerListError(f"{self.socket_path}: {reason}")
