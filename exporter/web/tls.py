"""TLS for the HTTP server: exporter-toolkit's ``tls_server_config`` settings as an ``ssl.SSLContext``.

:class:`TLSSettings` holds the settings of a web config file once they are validated (the rules
between keys are in :mod:`exporter.web.webconfig`); :func:`build_ssl_context` loads the
certificate, key and client CA they name and maps exporter-toolkit's names (Go's ``crypto/tls``
names) onto the ``ssl`` module's options with the tables below. :func:`peer_matches_sans` is
exporter-toolkit's ``client_allowed_sans`` check on a verified client certificate.

Where Python's ``ssl`` module cannot do what Go's crypto/tls does, the nearest safe behaviour is
chosen and documented in docs/security.md: ``RequestClientCert`` requests nothing (the exporter
never uses an unverified certificate), ``RequireAnyClientCert`` needs a client CA and then also
verifies, TLS 1.3 cipher suites are fixed by OpenSSL (as in Go), and only the first
``curve_preferences`` entry is used (Python 3.11 sets a single group).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from exporter.files import FileReadError, read_bytes

__all__ = [
    "CIPHERS_TLS12",
    "CIPHERS_TLS13",
    "CLIENT_AUTH_TYPES",
    "CURVES",
    "TLS_VERSIONS",
    "TLSConfigError",
    "TLSSettings",
    "build_ssl_context",
    "peer_matches_sans",
]

TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = MappingProxyType({
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
})

# exporter-toolkit's client_auth_type values -> the verify mode that enforces them ("" is unset).
# RequestClientCert verifies nothing and so asks for nothing; RequireAnyClientCert and
# RequireClientCert verify, because Python cannot require a certificate without verifying it.
_VERIFY_MODES: Mapping[str, ssl.VerifyMode] = MappingProxyType({
    "": ssl.CERT_NONE,
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_NONE,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "RequireClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
})
CLIENT_AUTH_TYPES: tuple[str, ...] = tuple(_VERIFY_MODES)

# Go's tls.CipherSuites() names -> OpenSSL names. Go ignores TLS 1.3 suites in this list (they are
# not configurable there); OpenSSL's set_ciphers() does not touch TLS 1.3 either.
CIPHERS_TLS12: Mapping[str, str] = MappingProxyType({
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
})
CIPHERS_TLS13: tuple[str, ...] = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")

# Go's tls.CurveID names -> OpenSSL group names.
CURVES: Mapping[str, str] = MappingProxyType({
    "CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519",
})

# Subject alternative names as getpeercert() spells their kinds; exporter-toolkit compares all four.
_SAN_KINDS = frozenset({"DNS", "email", "IP Address", "URI"})


class TLSConfigError(ValueError):
    """Certificate, key, client CA, cipher or curve that does not load; ``str()`` is one line naming
    the key or file and the reason, never the file's content."""


@dataclass(frozen=True)
class TLSSettings:
    """A validated ``tls_server_config``: file paths absolute, names known, defaults filled in."""

    cert_file: str = ""
    key_file: str = ""
    cert: str = ""  # inline PEM (newer exporter-toolkit)
    key: str = ""
    client_auth_type: str = ""
    client_ca_file: str = ""
    client_ca: str = ""
    cipher_suites: tuple[str, ...] = ()
    curve_preferences: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    prefer_server_cipher_suites: bool = True
    client_allowed_sans: tuple[str, ...] | None = None

    @property
    def enabled(self) -> bool:
        """exporter-toolkit's ``IsEnabled``: any TLS field set turns TLS on."""
        return any((self.cert_file, self.cert, self.key_file, self.key, self.client_ca_file, self.client_ca,
                    self.client_auth_type))

    @property
    def has_client_ca(self) -> bool:
        return bool(self.client_ca_file or self.client_ca)


def build_ssl_context(tls: TLSSettings) -> ssl.SSLContext | None:
    """A server SSL context for ``tls``, or None when TLS is off.

    :raises TLSConfigError: if the certificate, key or CA cannot be loaded, or no listed cipher or
        curve is available in this OpenSSL.
    """
    if not tls.enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # In this order, so that of several problems the same one is reported first every time.
    for step in _STEPS:
        step(ctx, tls)
    ctx.set_alpn_protocols(["http/1.1"])  # http2 is accepted in the file; Prometheus falls back via ALPN
    return ctx


def _versions(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    with warnings.catch_warnings():  # TLS10/TLS11 are deprecated in Python; honour them anyway
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = TLS_VERSIONS[tls.min_version]
        ctx.maximum_version = TLS_VERSIONS[tls.max_version]


def _no_password() -> bytes:
    raise TLSConfigError("the private key is encrypted (exporter-toolkit does not support passphrases either)")


def _read_pem(what: str, path: str) -> bytes:
    """A certificate, key or CA file, read as every file a person names is read
    (:func:`exporter.files.read_bytes`: a regular file only, opened without blocking, at most
    1 MiB): a reload runs on the serving loop, which a FIFO or a device put in the file's place
    must not stall, and OpenSSL, given the path, would open whatever is there."""
    try:
        return read_bytes(path)
    except FileReadError as exc:
        raise TLSConfigError(f"{what} {exc}") from None


def _pem_pair(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    """The certificate chain and key, from files or inline PEM, handed to OpenSSL as memfd paths
    (load_cert_chain reads paths only; the key never touches a disk)."""
    fds: list[int] = []

    def as_path(data: bytes, name: str) -> str:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        fds.append(fd)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return f"/proc/self/fd/{fd}"

    try:
        cert = _read_pem("cert_file", tls.cert_file) if tls.cert_file else tls.cert.encode()
        key = _read_pem("key_file", tls.key_file) if tls.key_file else tls.key.encode()
        _load_cert_chain(ctx, as_path(cert, "cert"), as_path(key, "key"))
    finally:
        for fd in fds:
            os.close(fd)


def _load_cert_chain(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except TLSConfigError:
        raise
    except PermissionError as exc:
        raise TLSConfigError(f"failed to read certificate or key: {exc.strerror} ({exc.filename})") from None
    except (ssl.SSLError, OSError) as exc:
        raise TLSConfigError(f"failed to load X509KeyPair: {_ssl_reason(exc)}") from None


def _ciphers(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    tls12 = [CIPHERS_TLS12[c] for c in tls.cipher_suites if c in CIPHERS_TLS12]
    if tls12:
        try:
            ctx.set_ciphers(":".join(tls12))
        except ssl.SSLError:
            raise TLSConfigError("tls_server_config.cipher_suites: none of the listed suites is available in this OpenSSL") from None
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE


def _curve(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    if not tls.curve_preferences:
        return
    # Python 3.11 can set only one group; the first preference is the one Go would pick with a Go
    # client, and restricting to it keeps the operator's restriction.
    first = tls.curve_preferences[0]
    try:
        ctx.set_ecdh_curve(CURVES[first])
    except (ValueError, ssl.SSLError):
        raise TLSConfigError(f"tls_server_config.curve_preferences: {first} is not available") from None


def _client_auth(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    mode = _VERIFY_MODES.get(tls.client_auth_type, ssl.CERT_NONE)
    if mode == ssl.CERT_NONE:
        return
    ctx.verify_mode = mode
    _client_ca(ctx, tls)
    if tls.has_client_ca and not ctx.get_ca_certs():
        raise TLSConfigError("tls_server_config: the client CA contains no certificates")


def _client_ca(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    cadata = tls.client_ca
    if tls.client_ca_file:
        try:
            cadata = _read_pem("tls_server_config.client_ca_file", tls.client_ca_file).decode("ascii")
        except UnicodeDecodeError:  # PEM is ASCII
            raise TLSConfigError(f"tls_server_config.client_ca_file {tls.client_ca_file}: not a PEM file") from None
    try:
        if cadata:
            ctx.load_verify_locations(cadata=cadata)
        else:
            ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # Go uses the system roots then
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TLSConfigError(f"tls_server_config: cannot load the client CA: {_ssl_reason(exc)}") from None


_STEPS: tuple[Callable[[ssl.SSLContext, TLSSettings], None], ...] = (_versions, _pem_pair, _ciphers, _curve, _client_auth)


def _ssl_reason(exc: BaseException) -> str:
    """OpenSSL's reason in words (``pem lib``, ``key values mismatch``), never a Python class name."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.library or 'ssl'}: {exc.reason}".replace("_", " ").lower()
    return " ".join(str(exc).split())


def peer_matches_sans(peer_cert: dict | None, allowed: tuple[str, ...]) -> bool:
    """exporter-toolkit's VerifyPeerCertificate: any DNS, email, IP or URI SAN equal to an allowed value."""
    if not peer_cert:
        return False
    allowed_set = set(allowed)
    return any(kind in _SAN_KINDS and _san_value(kind, value) in allowed_set
               for kind, value in peer_cert.get("subjectAltName", ()))


def _san_value(kind: str, value: str) -> str | None:
    """IP addresses as Go prints them (compressed); None for one that does not parse."""
    if kind != "IP Address":
        return value
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        return None
