"""Container health check: exit 0 if the exporter's ``/-/healthy`` answers 200, else 1.

Standard library only (the image has no curl). The URL follows the exporter's own configuration:
``GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS`` (default ``:19402``; a wildcard host is reached on
loopback) and ``https`` when ``GPU_ALLOC_EXPORTER_WEB_CONFIG_FILE`` names a file with a
``tls_server_config`` section (the certificate is not verified: this only asks the process
itself). ``GPU_ALLOC_EXPORTER_HEALTHCHECK_URL`` overrides all of that, e.g. when the listen address
is given as a flag rather than in the environment; credentials in it
(``http://user:password@127.0.0.1:19402/-/healthy``) are sent as basic auth, for a web config with
``basic_auth_users``.
"""

from __future__ import annotations

import base64
import os
import ssl
import sys
import urllib.parse
import urllib.request

DEFAULT_ADDRESS = ":19402"
TIMEOUT_SECONDS = 4.0


def health_url(environ: dict[str, str]) -> str:
    """The URL of ``/-/healthy`` for a process configured by ``environ``."""
    if environ.get("GPU_ALLOC_EXPORTER_HEALTHCHECK_URL"):
        return environ["GPU_ALLOC_EXPORTER_HEALTHCHECK_URL"]
    address = environ.get("GPU_ALLOC_EXPORTER_WEB_LISTEN_ADDRESS") or DEFAULT_ADDRESS
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{_scheme(environ.get('GPU_ALLOC_EXPORTER_WEB_CONFIG_FILE'))}://{host}:{port}/-/healthy"


def _scheme(web_config: str | None) -> str:
    if not web_config:
        return "http"
    try:
        with open(web_config, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "http"
    return "https" if "tls_server_config" in text else "http"


def request_for(url: str) -> urllib.request.Request:
    """A GET of ``url``; user and password in it become an Authorization header (and leave the URL)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return urllib.request.Request(url)
    netloc = parts.hostname if ":" not in (parts.hostname or "") else f"[{parts.hostname}]"
    if parts.port:
        netloc += f":{parts.port}"
    credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    request.add_header("Authorization", "Basic " + base64.b64encode(credentials.encode()).decode())
    return request


def main() -> int:
    request = request_for(health_url(dict(os.environ)))
    url = request.full_url
    context = ssl._create_unverified_context() if url.startswith("https:") else None  # noqa: S323 - loopback self-check
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS, context=context) as response:  # noqa: S310
            ok = response.status == 200
    except OSError as exc:  # URLError, HTTPError (non-2xx), timeouts, refused connections
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
