"""The Prometheus exporter-toolkit ``--web.config.file``: TLS, mTLS, basic auth, headers, rate limit.

Same YAML as every official exporter (node_exporter, Prometheus itself)::

    tls_server_config:
      cert_file: server.crt            # relative paths are resolved against this file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    http_server_config:
      headers:
        X-Content-Type-Options: nosniff
    basic_auth_users:
      prometheus: $2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG

Semantics reproduced from exporter-toolkit (``web/tls_config.go``, ``web/handler.go``):

* **Strict**: an unknown key, a duplicate key or a value of the wrong type is an error (the CLI
  exits 2 at startup). Only the five allowed response headers may be set, two of them only to
  enumerated values.
* TLS is on when any of cert/key/client CA/client auth is set; cert and key are then both required.
  A client CA without a client auth policy is an error, as is an unknown ``client_auth_type``.
* Basic auth: values are bcrypt hashes (``$2a$``, ``$2b$``, ``$2y$``). An unknown user is checked
  against a fixed fake hash, so response timing does not reveal which users exist. Results are
  cached per (user, hash, password); bcrypt (~60 ms at cost 10) runs in **one** worker thread,
  never on the serving loop. A flood of wrong passwords therefore queues there (bounded) while a
  scrape with the right password is answered from the cache.
* The file is re-checked while serving (its and the certificate files' inode, size and mtime,
  at most once per ``check_interval``). Rotated certificates take effect for new connections
  without a restart. A change that makes the file invalid is logged and **fails closed**: every
  request gets 500 until the file is fixed (as exporter-toolkit does); a certificate pair that does
  not load (e.g. the key is rewritten a moment after the cert) keeps the previous certificate.

Where Python's ``ssl`` module cannot do what Go's crypto/tls does, the nearest safe behaviour is
chosen and documented in docs/security.md: ``RequestClientCert`` requests nothing (the exporter
never uses an unverified certificate), ``RequireAnyClientCert`` needs a ``client_ca_file`` and then
also verifies, TLS 1.3 cipher suites are fixed by OpenSSL (as in Go), only the first
``curve_preferences`` entry is used (Python 3.11 sets a single group), and ``http2`` is accepted but
the server speaks HTTP/1.1 (Prometheus falls back via ALPN).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import ssl
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = [
    "ALLOWED_HEADERS",
    "Authenticator",
    "RateLimiter",
    "TLSSettings",
    "WebConfig",
    "WebConfigError",
    "WebConfigFile",
    "build_ssl_context",
    "load_web_config",
    "parse_web_config",
]

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20

# exporter-toolkit's extraHTTPHeaders: None = any value (checked only for header injection).
ALLOWED_HEADERS: Mapping[str, tuple[str, ...] | None] = MappingProxyType({
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
})

_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

_CLIENT_AUTH_TYPES = (
    "", "NoClientCert", "RequestClientCert", "RequireAnyClientCert", "RequireClientCert",
    "VerifyClientCertIfGiven", "RequireAndVerifyClientCert",
)

# Go's tls.CipherSuites() names -> OpenSSL names. Go ignores TLS 1.3 suites in this list (they are
# not configurable there); OpenSSL's set_ciphers() does not touch TLS 1.3 either.
_CIPHERS_TLS12 = {
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
}
_CIPHERS_TLS13 = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")

_CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}

_BCRYPT_HASH = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
# bcrypt("fakepassword", cost 10): unknown users are checked against it so they cost the same time.
FAKE_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"

class WebConfigError(Exception):
    """An unusable web config; ``str()`` is one line naming the file and the key."""


# -- parsing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSSettings:
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


@dataclass(frozen=True)
class WebConfig:
    """A validated web config. ``users`` maps user name (UTF-8 bytes) to its bcrypt hash."""

    path: str | None = None
    tls: TLSSettings = TLSSettings()
    headers: tuple[tuple[str, str], ...] = ()
    users: Mapping[bytes, bytes] = field(default_factory=lambda: MappingProxyType({}))
    http2: bool = True
    rate_limit: tuple[float, int] | None = None  # (seconds per token, burst)

    def files(self) -> tuple[str, ...]:
        """Files whose change means a reload: the config itself and the files it names."""
        t = self.tls
        return tuple(p for p in (self.path, t.cert_file, t.key_file, t.client_ca_file) if p)


@functools.cache
def _strict_loader() -> type:
    """A SafeLoader that rejects duplicate keys, as Go's yaml.UnmarshalStrict does. Built on first
    use: PyYAML costs ~20 ms of every start that has no web config file."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
        loader.flatten_mapping(node)
        out: dict = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise WebConfigError(f"line {key_node.start_mark.line + 1}: a mapping key must be a scalar") from None
            if key in out:
                raise WebConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} already set in map")
            out[key] = loader.construct_object(value_node, deep=True)
        return out

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read and validate a web config file, including that its certificates load.

    :raises WebConfigError: one line, naming the file.
    """
    path = os.path.abspath(os.fspath(path))
    config = parse_web_config(_read(path), path)
    _context_for(config)  # certificates, CA and cipher names must load now, not at the first handshake
    return config


def _context_for(config: WebConfig) -> ssl.SSLContext | None:
    """build_ssl_context with the file named in the error."""
    try:
        return build_ssl_context(config)
    except WebConfigError as exc:
        raise WebConfigError(f"web config {config.path}: {exc}" if config.path else str(exc)) from None


def parse_web_config(text: str, path: str | None = None) -> WebConfig:
    """Validate the YAML text of a web config (files it names are not read here)."""
    import yaml

    where = f"web config {path}" if path else "web config"
    try:
        doc = yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader subclass
    except WebConfigError as exc:
        raise WebConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        # Position and problem only: PyYAML's full message quotes the offending line.
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed"
        raise WebConfigError(f"{where}: not valid YAML{at}: {problem}") from None
    try:
        return _build(doc, path)
    except WebConfigError as exc:
        raise WebConfigError(f"{where}: {exc}") from None


# -- the schema: key names, nesting and types (pydantic); the rules between keys are below ---------


class _Schema(NamedTuple):
    """The pydantic models of a web config file: the whole file and its three sections."""

    root: Any
    tls: Any
    http: Any
    rate_limit: Any

    def section(self, key: str) -> Any:
        return {"tls_server_config": self.tls, "http_server_config": self.http, "rate_limit": self.rate_limit}[key]


@functools.cache
def _schema() -> _Schema:
    """Defined on the first load of a web config, not at import: pydantic costs ~20 MiB and ~0.15 s
    of a start that must stay within 1 s and 60 MiB, and most exporters run without a web config."""
    from pydantic import BaseModel, ConfigDict, Field

    class _Strict(BaseModel):
        # Like Go's yaml.UnmarshalStrict into exporter-toolkit's structs: unknown keys and values of the
        # wrong type are errors (no "3" for a bool, no 1.3 for a string).
        model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    class _TLSModel(_Strict):
        cert_file: str | None = None
        key_file: str | None = None
        cert: str | None = None
        key: str | None = None
        client_auth_type: str | None = None
        client_ca_file: str | None = None
        client_ca: str | None = None
        cipher_suites: list[str] | None = None
        curve_preferences: list[str] | None = None
        min_version: str | None = None
        max_version: str | None = None
        prefer_server_cipher_suites: bool = True
        client_allowed_sans: list[str] | None = None

    class _HTTPModel(_Strict):
        http2: bool = True
        headers: dict[str, str] | None = None

    class _RateLimitModel(_Strict):
        interval: int | str = 0  # a Go duration string, or an integer of nanoseconds
        burst: int = Field(0, ge=0)

    class _WebConfigModel(_Strict):
        tls_server_config: _TLSModel | None = None
        http_server_config: _HTTPModel | None = None
        basic_auth_users: dict[str, str] | None = None
        rate_limit: _RateLimitModel | None = None

    return _Schema(_WebConfigModel, _TLSModel, _HTTPModel, _RateLimitModel)


# What a wrong type is called in an error (pydantic's error types; never the value, never a class).
_EXPECTED = {
    "model_type": "expected a mapping", "model_attributes_type": "expected a mapping", "dict_type": "expected a mapping",
    "string_type": "expected a string", "bool_type": "expected true or false", "list_type": "expected a list of strings",
    "int_type": "expected an integer", "greater_than_equal": "expected a non-negative integer",
}


def _schema_error(error: Any, schema: _Schema) -> WebConfigError:
    """One pydantic error as one line: the dotted key and the reason."""
    loc = [str(p) for p in error["loc"] if p != "[key]"]
    if error["loc"] and error["loc"][-1] == "[key]":
        return WebConfigError(f"{'.'.join(loc[:-1]) or 'top level'}: a key is not a string (quote it)")
    # A union (int | str) reports each member; the type names are pydantic's, so name the field only.
    loc = [p for p in loc if p not in ("int", "str")]
    key = ".".join(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        model = schema.root
        for part in loc[:-1]:
            model = schema.section(part)
        return WebConfigError(f"unknown key '{key}' (allowed: {', '.join(model.model_fields)})")
    if key == "basic_auth_users" or key.startswith("basic_auth_users."):
        if kind == "string_type" and len(loc) == 2:
            return WebConfigError(f"{key}: expected a bcrypt hash string")
    if key == "rate_limit.interval":
        return WebConfigError(f"{key}: expected a duration such as 1s")
    return WebConfigError(f"{key or 'top level'}: {_EXPECTED.get(kind, 'not valid here')}")


def _build(doc: Any, path: str | None) -> WebConfig:
    from pydantic import ValidationError

    schema = _schema()
    try:
        model = schema.root.model_validate({} if doc is None else doc)
    except ValidationError as exc:
        raise _schema_error(exc.errors(include_input=False, include_url=False)[0], schema) from None
    base = os.path.dirname(path) if path else os.getcwd()
    tls = _tls(model.tls_server_config or schema.tls(), base)
    http = model.http_server_config or schema.http()
    users = _users(model.basic_auth_users or {})
    rate = _rate_limit(model.rate_limit or schema.rate_limit())
    return WebConfig(path, tls, _headers(http.headers or {}), MappingProxyType(users), http.http2, rate)


def _join(base: str, p: str) -> str:
    """prometheus/common's JoinDir: relative paths are relative to the config file's directory."""
    return p if not p or os.path.isabs(p) else os.path.join(base, p)


def _tls(raw: Any, base: str) -> TLSSettings:  # raw: the validated tls_server_config
    w = "tls_server_config"
    s = {k: getattr(raw, k) or "" for k in
         ("cert_file", "key_file", "cert", "key", "client_auth_type", "client_ca_file", "client_ca")}
    for k in ("cert_file", "key_file", "client_ca_file"):
        s[k] = _join(base, s[k])
    for a, b in (("cert", "cert_file"), ("key", "key_file"), ("client_ca", "client_ca_file")):
        if s[a] and s[b]:
            raise WebConfigError(f"{w}: at most one of {a} and {b} must be configured")
    ciphers = tuple(raw.cipher_suites or ())
    for i, name in enumerate(ciphers):
        if name not in _CIPHERS_TLS12 and name not in _CIPHERS_TLS13:
            raise WebConfigError(f"{w}.cipher_suites[{i}]: unknown cipher (Go's tls.CipherSuites() names)")
    curves = tuple(raw.curve_preferences or ())
    for i, name in enumerate(curves):
        if name not in _CURVES:
            raise WebConfigError(f"{w}.curve_preferences[{i}]: unknown curve (allowed: {', '.join(_CURVES)})")
    versions = {}
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = getattr(raw, k) or default
        if v not in _TLS_VERSIONS:
            raise WebConfigError(f"{w}.{k}: unknown TLS version (allowed: {', '.join(_TLS_VERSIONS)})")
        versions[k] = v
    sans = raw.client_allowed_sans
    tls = TLSSettings(**s, cipher_suites=ciphers, curve_preferences=curves,
                      prefer_server_cipher_suites=raw.prefer_server_cipher_suites,
                      client_allowed_sans=None if sans is None else tuple(sans), **versions)
    if not tls.enabled:
        return tls
    if not (tls.cert_file or tls.cert):
        raise WebConfigError(f"{w}: missing one of cert or cert_file")
    if not (tls.key_file or tls.key):
        raise WebConfigError(f"{w}: missing one of key or key_file")
    if tls.client_auth_type not in _CLIENT_AUTH_TYPES:
        raise WebConfigError(f"{w}.client_auth_type: invalid ClientAuth (allowed: {', '.join(_CLIENT_AUTH_TYPES[1:])})")
    no_auth = tls.client_auth_type in ("", "NoClientCert")
    if (tls.client_ca_file or tls.client_ca) and no_auth:
        raise WebConfigError(f"{w}: client CA's have been configured without a Client Auth Policy")
    if tls.client_allowed_sans is not None and tls.client_auth_type not in (
        "RequireAnyClientCert", "RequireClientCert", "RequireAndVerifyClientCert"
    ):
        raise WebConfigError(f"{w}: client_allowed_sans requires client_auth_type to be one of "
                             "RequireAnyClientCert or RequireAndVerifyClientCert")
    if tls.client_auth_type in ("RequireAnyClientCert", "RequireClientCert") and not (tls.client_ca_file or tls.client_ca):
        raise WebConfigError(f"{w}: client_auth_type {tls.client_auth_type} needs client_ca_file here: Python's ssl "
                             "module cannot require a client certificate without verifying it")
    if _TLS_VERSIONS[tls.min_version] > _TLS_VERSIONS[tls.max_version]:
        raise WebConfigError(f"{w}: min_version {tls.min_version} is above max_version {tls.max_version}")
    return tls


def _headers(raw: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    w = "http_server_config.headers"
    out = []
    for name, value in raw.items():
        if name not in ALLOWED_HEADERS:
            raise WebConfigError(f'{w}: HTTP header "{name}" can not be configured')
        allowed = ALLOWED_HEADERS[name]
        if allowed is not None and value not in allowed:
            shown = "[" + " ".join(f'"{a}"' for a in allowed) + "]"
            raise WebConfigError(f"{w}: invalid value for {name}. Expected one of: {shown}")
        if any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in value) or not value.isascii():
            raise WebConfigError(f"{w}.{name}: value contains control or non-ASCII characters")
        out.append((name, value))
    return tuple(out)


def _users(raw: Mapping[str, str]) -> dict[bytes, bytes]:
    w = "basic_auth_users"
    out = {}
    for user, hashed in raw.items():
        m = _BCRYPT_HASH.match(hashed)
        if not m:
            raise WebConfigError(f"{w}.{user}: not a bcrypt hash ($2a$, $2b$ or $2y$, cost, 53 characters of salt and hash)")
        if not 4 <= int(m.group(1)) <= 31:
            raise WebConfigError(f"{w}.{user}: the bcrypt cost is outside 4..31")
        out[user.encode()] = hashed.encode()
    return out


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_go_duration(text: str) -> float:
    """Go's ``time.ParseDuration`` (``1s``, ``250ms``, ``1m30s``, ``0``) in seconds."""
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if not m:
            raise ValueError(f"time: invalid duration {text!r}")
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not text:
        raise ValueError("time: invalid duration ''")
    return total


def _rate_limit(raw: Any) -> tuple[float, int] | None:  # raw: the validated rate_limit
    w = "rate_limit"
    if isinstance(raw.interval, int):
        seconds = raw.interval * 1e-9  # a bare YAML integer is nanoseconds for a Go time.Duration
    else:
        try:
            seconds = parse_go_duration(raw.interval)
        except ValueError:
            raise WebConfigError(f"{w}.interval: invalid duration (a Go duration such as 250ms or 1m30s)") from None
    return (seconds, raw.burst) if seconds > 0 else None


# -- TLS ---------------------------------------------------------------------------------------------


def _no_password() -> bytes:
    raise WebConfigError("the private key is encrypted (exporter-toolkit does not support passphrases either)")


def _load_pem_pair(ctx: ssl.SSLContext, tls: TLSSettings) -> None:
    fds: list[int] = []

    def as_path(inline: str, name: str) -> str:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        fds.append(fd)
        os.write(fd, inline.encode())
        return f"/proc/self/fd/{fd}"

    try:
        cert = tls.cert_file or as_path(tls.cert, "cert")
        key = tls.key_file or as_path(tls.key, "key")
        for what, p in (("cert_file", tls.cert_file), ("key_file", tls.key_file)):
            if p and not os.path.isfile(p):
                raise WebConfigError(f"failed to read {what} ({p}): " + ("no such file" if not os.path.exists(p) else "not a regular file"))
        try:
            ctx.load_cert_chain(cert, key, password=_no_password)
        except WebConfigError:
            raise
        except PermissionError as exc:
            raise WebConfigError(f"failed to read certificate or key: {exc.strerror} ({exc.filename})") from None
        except (ssl.SSLError, OSError) as exc:
            raise WebConfigError(f"failed to load X509KeyPair: {_ssl_reason(exc)}") from None
    finally:
        for fd in fds:
            os.close(fd)


def _ssl_reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.library or 'ssl'}: {exc.reason}".replace("_", " ").lower()
    return " ".join(str(exc).split())


def build_ssl_context(config: WebConfig) -> ssl.SSLContext | None:
    """An SSL context for the config's TLS settings, or None when TLS is off.

    :raises WebConfigError: if the certificate, key or CA cannot be loaded.
    """
    tls = config.tls
    if not tls.enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():  # TLS10/TLS11 are deprecated in Python; honour them anyway
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = _TLS_VERSIONS[tls.min_version]
        ctx.maximum_version = _TLS_VERSIONS[tls.max_version]
    _load_pem_pair(ctx, tls)
    tls12 = [_CIPHERS_TLS12[c] for c in tls.cipher_suites if c in _CIPHERS_TLS12]
    if tls12:
        try:
            ctx.set_ciphers(":".join(tls12))
        except ssl.SSLError:
            raise WebConfigError("tls_server_config.cipher_suites: none of the listed suites is available in this OpenSSL") from None
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    if tls.curve_preferences:
        # Python 3.11 can set only one group; the first preference is the one Go would pick
        # with a Go client, and restricting to it keeps the operator's restriction.
        try:
            ctx.set_ecdh_curve(_CURVES[tls.curve_preferences[0]])
        except (ValueError, ssl.SSLError):
            raise WebConfigError(f"tls_server_config.curve_preferences: {tls.curve_preferences[0]} is not available") from None
    auth = tls.client_auth_type
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert", "RequireAnyClientCert", "RequireClientCert"):
        ctx.verify_mode = ssl.CERT_OPTIONAL if auth == "VerifyClientCertIfGiven" else ssl.CERT_REQUIRED
        try:
            if tls.client_ca_file:
                ctx.load_verify_locations(cafile=tls.client_ca_file)
            elif tls.client_ca:
                ctx.load_verify_locations(cadata=tls.client_ca)
            else:
                ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)  # Go uses the system roots then
        except FileNotFoundError:
            raise WebConfigError(f"tls_server_config.client_ca_file: no such file ({tls.client_ca_file})") from None
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise WebConfigError(f"tls_server_config: cannot load the client CA: {_ssl_reason(exc)}") from None
        if (tls.client_ca_file or tls.client_ca) and not ctx.get_ca_certs():
            raise WebConfigError("tls_server_config: the client CA contains no certificates")
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def peer_matches_sans(peer_cert: dict | None, allowed: tuple[str, ...]) -> bool:
    """exporter-toolkit's VerifyPeerCertificate: any DNS, email, IP or URI SAN equal to an allowed value."""
    if not peer_cert:
        return False
    allowed_set = set(allowed)
    for kind, value in peer_cert.get("subjectAltName", ()):
        if kind == "IP Address":
            try:
                value = str(ipaddress.ip_address(value.strip()))
            except ValueError:
                continue
        if kind in ("DNS", "email", "IP Address", "URI") and value in allowed_set:
            return True
    return False


# -- basic auth --------------------------------------------------------------------------------------


def parse_basic_auth(header: str) -> tuple[bytes, bytes] | None:
    """``Authorization: Basic base64(user:password)`` → (user, password) as bytes, else None."""
    scheme, _, param = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(param.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    return (user, password) if sep else None


class Authenticator:
    """bcrypt checks with a cache, in one worker thread, never on the event loop, fair across clients.

    Verified credentials are cached (keyed digests, LRU) and answered at once, so a scraper that got
    in once never waits on bcrypt again. Uncached checks queue per client address and the worker
    takes them round-robin across addresses: a flood of guesses from one address delays a first
    login from another by at most one bcrypt run per busy address, instead of a whole queue.

    Only failures are limited, per address: at most ``max_pending_per_peer`` uncached checks wait at
    once, and an address that failed ``failure_burst`` times gets no further uncached check until its
    budget refills (one attempt per ``failure_interval`` seconds). Beyond either, :meth:`check`
    answers None (the server says 429). A client sharing its address with a guesser shares its
    budget; one from another address is never refused.

    Passwords are compared as Go's ``bcrypt.CompareHashAndPassword`` does (exporter-toolkit): only
    the first 72 bytes count, so a hash made by a tool that truncated a longer password matches.
    """

    def __init__(self, max_pending_per_peer: int = 8, cache_size: int = 1024, failure_burst: int = 10,
                 failure_interval: float = 1.0, max_peers: int = 4096,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.max_pending_per_peer = max_pending_per_peer
        self.cache_size = cache_size
        self.failure_burst, self.failure_interval, self.max_peers = failure_burst, failure_interval, max_peers
        self._monotonic = monotonic
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._key = secrets.token_bytes(32)  # the cache holds keyed digests, never passwords
        self._lanes: OrderedDict[str, deque[tuple[bytes, bytes, asyncio.Future]]] = OrderedDict()
        self._failures: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)
        self._pending = 0  # checks queued or running
        self._running = False
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.bcrypt_runs = 0

    def _cache_key(self, user: bytes, hashed: bytes, password: bytes) -> bytes:
        parts = b"\x00".join(base64.b64encode(p) for p in (user, hashed, password))
        return hmac.new(self._key, parts, hashlib.sha256).digest()

    def cached(self, users: Mapping[bytes, bytes], user: bytes, password: bytes) -> bool | None:
        """The cached verdict, or None if bcrypt has to run."""
        known = user in users
        key = self._cache_key(user, users.get(user, FAKE_HASH), password)
        with self._lock:
            verdict = self._cache.get(key)
            if verdict is not None:
                self._cache.move_to_end(key)
        return None if verdict is None else (verdict and known)

    def _failure_tokens(self, peer: str) -> float:
        tokens, at = self._failures.get(peer, (float(self.failure_burst), 0.0))
        return min(float(self.failure_burst), tokens + (self._monotonic() - at) / self.failure_interval)

    def _failed(self, peer: str) -> None:
        self._failures[peer] = (self._failure_tokens(peer) - 1.0, self._monotonic())
        self._failures.move_to_end(peer)
        while len(self._failures) > self.max_peers:
            self._failures.popitem(last=False)

    async def check(self, users: Mapping[bytes, bytes], user: bytes, password: bytes, peer: str = "") -> bool | None:
        """Verify a login from address ``peer``; None means refused for now (too many pending or
        failed checks from that address)."""
        verdict = self.cached(users, user, password)
        if verdict is not None:
            if not verdict:
                self._failed(peer)
            return verdict
        lane = self._lanes.get(peer)
        if (lane is not None and len(lane) >= self.max_pending_per_peer) or self._failure_tokens(peer) < 1.0:
            return None
        known = user in users
        hashed = users.get(user, FAKE_HASH)
        future = asyncio.get_running_loop().create_future()
        if lane is None:
            lane = self._lanes[peer] = deque()
        lane.append((hashed, password, future))
        self._pending += 1
        self._next()
        ok = await future
        key = self._cache_key(user, hashed, password)
        with self._lock:
            self._cache[key] = ok
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if not (ok and known):
            self._failed(peer)
        return ok and known

    def _next(self) -> None:
        """Start the next check: the first waiting address's oldest, then that address goes last."""
        while not self._running and self._lanes:
            peer, lane = next(iter(self._lanes.items()))
            hashed, password, future = lane.popleft()
            if lane:
                self._lanes.move_to_end(peer)
            else:
                del self._lanes[peer]
            if future.done():  # its connection went away while it waited
                self._pending -= 1
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcrypt")
            self._running = True
            job = asyncio.get_running_loop().run_in_executor(self._executor, self._bcrypt, hashed, password)
            job.add_done_callback(lambda job, future=future: self._done(job, future))

    def _done(self, job: asyncio.Future, future: asyncio.Future) -> None:
        self._running = False
        self._pending -= 1
        if not future.done():
            if job.cancelled() or job.exception() is not None:
                future.set_result(False)
            else:
                future.set_result(job.result())
        self._next()

    def _bcrypt(self, hashed: bytes, password: bytes) -> bool:
        import bcrypt

        self.bcrypt_runs += 1
        try:
            # Go's CompareHashAndPassword keys Blowfish with the first 72 bytes only; bcrypt 5 raises
            # on longer passwords instead of truncating.
            return bcrypt.checkpw(password[:72], hashed)
        except ValueError:  # a malformed salt
            return False

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


class RateLimiter:
    """A token bucket like Go's ``rate.NewLimiter(rate.Every(interval), burst)``."""

    def __init__(self, interval: float, burst: int, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.burst, self._monotonic = interval, burst, monotonic
        self._tokens = float(burst)
        self._last = monotonic()

    def allow(self) -> bool:
        now = self._monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) / self.interval)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


# -- live source ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Active:
    """What the server enforces right now."""

    config: WebConfig
    ssl_context: ssl.SSLContext | None
    error: str | None = None  # the file changed and is now invalid: fail closed (500)


def _signature(paths: tuple[str, ...]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError as exc:
            out.append(exc.errno)
    return tuple(out)


class WebConfigFile:
    """A web config file that is re-checked while serving.

    :param path: the ``--web.config.file``.
    :param check_interval: seconds between stat checks of the file and the files it names
        (0 = on every request and every new connection, as exporter-toolkit does).
    """

    def __init__(self, path: str | os.PathLike[str], check_interval: float = 1.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.check_interval = check_interval
        self._monotonic = monotonic
        self._active: Active | None = None
        self._signature: tuple = ()
        self._next_check = 0.0
        self._lock = threading.Lock()
        self.reloads_total = 0
        self.reload_failures_total = 0
        self.last_reload_successful = True
        self.authenticator = Authenticator()
        self._limiter: RateLimiter | None = None

    def load(self) -> Active:
        """The first load, at startup. :raises WebConfigError: the CLI exits 2."""
        config = load_web_config(self.path)
        with self._lock:
            self._signature = _signature(config.files())
            self._active = Active(config, _context_for(config))
            self._limiter = self._make_limiter(config, None)
            self._next_check = self._monotonic() + self.check_interval
        log.info("web config %s loaded: TLS %s, basic auth %s", self.path, "on" if config.tls.enabled else "off",
                 f"{len(config.users)} user(s)" if config.users else "off")
        return self._active

    def current(self) -> Active:
        """The config to enforce now, reloaded first if any of its files changed."""
        active = self._active
        if active is None:
            return self.load()
        now = self._monotonic()
        if now < self._next_check:
            return active
        with self._lock:
            self._next_check = now + self.check_interval
            sig = _signature(active.config.files())
            if sig == self._signature:
                return self._active
            self._signature = sig
            self.reloads_total += 1
            try:
                config = parse_web_config(_read(self.path), self.path)
                # Re-sign with the files the *new* config names, so later edits to them are seen.
                self._signature = _signature(config.files())
                try:
                    ctx = _context_for(config)
                except WebConfigError as exc:
                    if active.ssl_context is None or not config.tls.enabled:
                        raise
                    # A rotation in progress (cert written, key not yet): keep serving the old pair.
                    log.error("%s; keeping the previous certificate until it loads", exc)
                    self.reload_failures_total += 1
                    self.last_reload_successful = False
                    self._active = Active(config, active.ssl_context)
                    self._limiter = self._make_limiter(config, active.config)
                    return self._active
            except WebConfigError as exc:
                log.error("%s; refusing requests (500) until it is fixed", exc)
                self.reload_failures_total += 1
                self.last_reload_successful = False
                self._active = Active(active.config, active.ssl_context, error=str(exc))
                return self._active
            log.info("web config %s reloaded", self.path)
            self.last_reload_successful = True
            self._limiter = self._make_limiter(config, active.config)
            self._active = Active(config, ctx)
            return self._active

    def _make_limiter(self, new: WebConfig, old: WebConfig | None) -> RateLimiter | None:
        if new.rate_limit is None:
            return None
        if old is not None and old.rate_limit == new.rate_limit and self._limiter is not None:
            return self._limiter
        return RateLimiter(*new.rate_limit)

    def allow_request(self) -> bool:
        limiter = self._limiter
        return limiter is None or limiter.allow()

    def close(self) -> None:
        self.authenticator.close()


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise WebConfigError(f"web config {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise WebConfigError(f"web config {path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise WebConfigError(f"web config {path}: not UTF-8 text") from None
