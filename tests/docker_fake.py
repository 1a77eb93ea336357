"""A Docker daemon on a unix socket that answers ``GET /containers/json`` (kernel labels)."""

from __future__ import annotations

import json
import socketserver
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path


def container(kernel_id: str, session_id: str, user_id: str | None = "f38dea23-50fa-42a0-b5ae-338f5f4693f4", **extra: str) -> dict:
    """One entry of ``GET /containers/json`` as the Docker Engine API answers it for a kernel."""
    labels = {"ai.backend.kernel-id": kernel_id, "ai.backend.session-id": session_id,
              "ai.backend.agent-id": "i-gpu-node01", "ai.backend.session-type": "interactive",
              "ai.backend.service-ports": "jupyter:http:8080", **extra}
    if user_id is not None:
        labels["ai.backend.owner-user-id"] = user_id
    return {"Id": "3b9e1c0d" * 8, "Names": [f"/kernel.python.{kernel_id[:8]}"], "Image": "cr.backend.ai/python:3.11",
            "Labels": labels, "State": "running", "Status": "Up 5 minutes"}


class FakeDocker:
    """A Docker Engine API endpoint on a unix socket: answers ``/containers/json`` (honouring the
    label filter) and records every request line, so a test can tell nothing else was asked."""

    def __init__(self, path: Path, containers: list[dict]) -> None:
        self.path, self.containers, self.requests = path, containers, []
        self.status, self.body, self.drip = 200, None, 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.requests.append(self.path)
                url = urllib.parse.urlsplit(self.path)
                if url.path != "/containers/json":
                    self.send_error(404)
                    return
                filters = json.loads(urllib.parse.parse_qs(url.query).get("filters", ["{}"])[0])
                wanted = filters.get("label", [])
                listed = [c for c in fake.containers if all(w in c["Labels"] for w in wanted)]
                body = fake.body if fake.body is not None else json.dumps(listed).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(0, len(body), 64):
                    self.wfile.write(body[i:i + 64])
                    self.wfile.flush()
                    time.sleep(fake.drip)

            def log_message(self, *args: object) -> None:
                pass

        self.server = socketserver.UnixStreamServer(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
