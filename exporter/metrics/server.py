"""The HTTP server's protection counters as metric families.

:class:`ServerStats` is an immutable snapshot of what the server (``exporter/web/server.py``)
refused, evicted and holds; :func:`server_families` renders it. The server counts; this module
only names and renders, so that the web layer depends on metrics and never the reverse.

Every refusal counts in ``gpu_alloc_http_requests_rejected_total{reason}``: a request that is
answered with an error status, or a connection that the server closes for one of these reasons,
named after the limit or setting that refused (``Limits`` fields, web config keys):

* ``max_connections``: a new connection arrived at the connection cap and no silent or idle
  connection could be evicted to make room (503).
* ``max_offloaded``: a document route (JSON API, what-if placement) arrived while the worker
  pool's queue was full (503).
* ``max_held_bytes``: a document route or a ``/metrics`` body arrived, or a response was built,
  while the response bytes held for clients that do not read were at their budget (503); also a
  client still being sent a superseded ``/metrics`` body, dropped to make room for the current one.
* ``max_header_bytes``: the request line and headers were larger than allowed (431).
* ``max_body_bytes``: the request body was larger than allowed (413).
* ``malformed``: the request did not parse or was ambiguous: framing, target, header characters,
  conflicting lengths, HTTP version (400, 501, 505).
* ``plain_http``: plain HTTP sent to the TLS port (400, as Go's net/http answers).
* ``first_byte_timeout``: a new connection sent nothing within the first-byte deadline (closed).
* ``header_timeout``: a request head or body did not arrive within its deadline (closed; slowloris).
* ``write_timeout``: the client did not take its response within the write deadline (closed).
* ``tls_handshake``: the TLS handshake failed: no or an untrusted client certificate, no common
  protocol or cipher, or the client gave up (closed).
* ``tls_handshake_timeout``: the TLS handshake did not finish within its deadline (closed).
* ``tls_disabled``: a TLS connection arrived after the web config turned TLS off; TLS is refused
  until a restart (closed).
* ``client_allowed_sans``: the verified client certificate has none of the allowed SANs (closed).
* ``rate_limit``: the web config's ``rate_limit`` had no token left (429).
* ``auth_throttled``: too many password checks were waiting (per address or in all), or one
  waited too long for its turn (429); wrong passwords are slowed to a bcrypt budget, not refused.
* ``unauthorized``: basic auth is on and the credentials were missing or wrong (401).
* ``config_invalid``: the web config file became invalid; every request fails closed (500).

Not counted: a keep-alive connection closed after its idle timeout (the normal end of a
connection), a client that closes its connection, 404/405 answers, and a handler that fails (500).
A connection closed to make room at the cap counts in ``gpu_alloc_http_connections_evicted_total``
instead, whatever state it was in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from exporter.metrics.collectors import Inputs, Part, register
from exporter.metrics.families import counter, gauge

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["REJECT_REASONS", "ServerStats", "server_families"]

# Every reason, in the order exported; see the module docstring for what each means.
REJECT_REASONS: tuple[str, ...] = (
    "max_connections",
    "max_offloaded",
    "max_held_bytes",
    "max_header_bytes",
    "max_body_bytes",
    "malformed",
    "plain_http",
    "first_byte_timeout",
    "header_timeout",
    "write_timeout",
    "tls_handshake",
    "tls_handshake_timeout",
    "tls_disabled",
    "client_allowed_sans",
    "rate_limit",
    "auth_throttled",
    "unauthorized",
    "config_invalid",
)


@dataclass(frozen=True)
class ServerStats:
    """What the HTTP server refused, evicted and holds, at one moment.

    :param rejected: reason -> refusals since start. Reasons left out are 0; every one of
        :data:`REJECT_REASONS` is present afterwards, in that order, and no other.
    :param evicted: connections closed to make room at the connection cap, since start.
    :param held_bytes: bytes of document responses built and not yet written to their clients.
    :raises ValueError: a reason that is not one of :data:`REJECT_REASONS`, or a negative figure.
    """

    rejected: Mapping[str, int] = field(default_factory=dict)
    evicted: int = 0
    held_bytes: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rejected) - set(REJECT_REASONS))
        if unknown:
            raise ValueError(f"unknown rejection reason(s): {', '.join(unknown)}")
        counts = {reason: int(self.rejected.get(reason, 0)) for reason in REJECT_REASONS}
        if min(counts.values()) < 0 or self.evicted < 0 or self.held_bytes < 0:
            raise ValueError("server counters cannot be negative")
        object.__setattr__(self, "rejected", MappingProxyType(counts))


def server_families(stats: ServerStats) -> list[Metric]:
    """The HTTP server's families: refusals by reason (each reason always present), evictions,
    and the bytes held for slow readers."""
    rejected = counter(
        "gpu_alloc_http_requests_rejected",
        "HTTP requests and connections refused by the exporter's server, by reason (limits, timeouts, TLS, auth, malformed)",
        ["reason"],
    )
    for reason, count in stats.rejected.items():
        rejected.add_metric([reason], count)
    evicted = counter(
        "gpu_alloc_http_connections_evicted",
        "Connections closed to make room at the connection cap (the oldest silent, else idle, first)",
        value=stats.evicted,
    )
    held = gauge(
        "gpu_alloc_http_held_bytes",
        "Bytes of document responses built and not yet written to slow-reading clients",
        value=stats.held_bytes,
    )
    return [rejected, evicted, held]


@register("http", "the HTTP server's refusals by reason, evicted connections and bytes held for slow readers", order=90)
def _http(inputs: Inputs) -> list[Part]:
    if inputs.server is None:  # not served over HTTP (scan, tests of the collector alone)
        return []
    return [Part("http", lambda: server_families(inputs.server()), inputs.server)]
