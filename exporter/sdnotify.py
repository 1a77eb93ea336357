"""systemd's readiness protocol (``sd_notify(3)``): tell the service manager when the exporter is
ready and when it stops, so a ``Type=notify`` unit is "active" only once ``/-/ready`` answers 200.

The protocol is one datagram of ``KEY=value`` lines to the unix socket named by ``$NOTIFY_SOCKET``
(a path, or an abstract name written with a leading ``@``). Without that variable nothing is sent.
libsystemd's C function is not needed for three fixed messages.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["notify"]

log = logging.getLogger(__name__)


def notify(message: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` (``READY=1``, ``STOPPING=1``, ``STATUS=...``) to the service manager.

    :returns: whether it was sent; False without ``$NOTIFY_SOCKET`` or when the socket refuses
        it (the manager is gone: the exporter goes on, and says so at debug level).
    """
    address = environ.get("NOTIFY_SOCKET", "")
    if not address or address[0] not in "/@":
        return False  # unset, or a vsock address ("vsock:...") this exporter does not speak
    if address[0] == "@":
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode("utf-8", "replace"))
    except OSError as exc:
        log.debug("cannot notify the service manager at %s: %s", environ["NOTIFY_SOCKET"], exc.strerror or exc)
        return False
    return True
