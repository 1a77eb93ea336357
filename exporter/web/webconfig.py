"""The Prometheus exporter-toolkit ``--web.config.file``: its schema, loading, and reloading while serving.

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
  enumerated values. The schema is pydantic models; the rules between keys are their validators.
* TLS is on when any of cert/key/client CA/client auth is set; cert and key are then both required.
  A client CA without a client auth policy is an error, as is an unknown ``client_auth_type``.
  :mod:`exporter.web.tls` turns the settings into an SSL context.
* Basic auth: values are bcrypt hashes (``$2a$``, ``$2b$``, ``$2y$``) of cost 4 to 31; checking a
  password is :mod:`exporter.web.auth`'s.
* The file is re-checked while serving (its and the certificate files' inode, size and mtime,
  at most once per ``check_interval``). Rotated certificates take effect for new connections
  without a restart. A change that makes the file invalid is logged and **fails closed**: every
  request gets 500 until the file is fixed (as exporter-toolkit does); a certificate pair that does
  not load (e.g. the key is rewritten a moment after the cert) keeps the previous certificate.

``http2`` is accepted but the server speaks HTTP/1.1 (Prometheus falls back via ALPN); what else
Python's ``ssl`` module does differently from Go is in :mod:`exporter.web.tls` and docs/security.md.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from exporter.files import MAX_FILE_BYTES, FileReadError, read_text
from exporter.web.auth import Authenticator, RateLimiter
from exporter.web.tls import (
    CIPHERS_TLS12,
    CIPHERS_TLS13,
    CLIENT_AUTH_TYPES,
    CURVES,
    TLS_VERSIONS,
    TLSConfigError,
    TLSSettings,
    build_ssl_context,
)

__all__ = [
    "ALLOWED_HEADERS",
    "Active",
    "WebConfig",
    "WebConfigError",
    "WebConfigFile",
    "load_web_config",
    "parse_go_duration",
    "parse_web_config",
]

log = logging.getLogger(__name__)

# exporter-toolkit's extraHTTPHeaders: None = any value (checked only for header injection).
ALLOWED_HEADERS: Mapping[str, tuple[str, ...] | None] = MappingProxyType({
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
})

_BCRYPT_HASH = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")


class WebConfigError(Exception):
    """An unusable web config; ``str()`` is one line naming the file and the key."""


# -- parsing ---------------------------------------------------------------------------------------


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
        return build_ssl_context(config.tls)
    except TLSConfigError as exc:
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


def _build(doc: Any, path: str | None) -> WebConfig:
    from pydantic import ValidationError

    schema = _schema()
    try:
        model = schema.root.model_validate({} if doc is None else doc)
    except ValidationError as exc:
        raise _schema_error(exc.errors(include_input=False, include_url=False), schema) from None
    base = os.path.dirname(path) if path else os.getcwd()
    tls = (model.tls_server_config or schema.tls()).settings(base)
    http = model.http_server_config or schema.http()
    users = {user.encode(): hashed.encode() for user, hashed in (model.basic_auth_users or {}).items()}
    rate = (model.rate_limit or schema.rate_limit()).limit()
    return WebConfig(path, tls, tuple((http.headers or {}).items()), MappingProxyType(users), http.http2, rate)


# -- the schema: key names, nesting and types, and the rules between keys as validators -------------


class _Schema(NamedTuple):
    """The pydantic models of a web config file: the whole file and its three sections."""

    root: Any
    tls: Any
    http: Any
    rate_limit: Any

    def section(self, key: str) -> Any:
        return {"tls_server_config": self.tls, "http_server_config": self.http, "rate_limit": self.rate_limit}[key]


# The pydantic error type of a broken rule between keys; its message is complete (key and reason).
_RULE = "web_config_rule"
# Of several sections with a broken rule, the one reported (the order is part of the behaviour).
_RULE_ORDER = ("tls_server_config", "basic_auth_users", "rate_limit", "http_server_config")
_TLS = "tls_server_config"
_TLS_STRINGS = ("cert_file", "key_file", "cert", "key", "client_auth_type", "client_ca_file", "client_ca")
_TLS_FILES = ("cert_file", "key_file", "client_ca_file")


@functools.cache
def _schema() -> _Schema:
    """Defined on the first load of a web config, not at import: pydantic costs ~20 MiB and ~0.15 s
    of a start that must stay within 1 s and 60 MiB, and most exporters run without a web config.

    Each rule between keys is a validator that runs once the types are right; of several broken
    rules in one section, the first is reported (``_TLS_RULES`` in order, headers and users in the
    file's order)."""
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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

        def settings(self, base: str = "") -> TLSSettings:
            """The settings with defaults filled in and file paths resolved against ``base``."""
            return _tls_settings(self, base)

        @model_validator(mode="after")
        def _rules_between_keys(self) -> _TLSModel:
            tls = self.settings()
            for rule in _TLS_RULES:  # in order: the first broken one is reported
                _check(rule(tls))
            return self

    class _HTTPModel(_Strict):
        http2: bool = True
        headers: dict[str, str] | None = None

        @field_validator("headers")
        @classmethod
        def _allowed_headers(cls, headers: dict[str, str] | None) -> dict[str, str] | None:
            _check(_first(_header_problem(name, value) for name, value in (headers or {}).items()))
            return headers

    class _RateLimitModel(_Strict):
        interval: int | str = 0  # a Go duration string, or an integer of nanoseconds
        burst: int = Field(0, ge=0)

        @field_validator("interval")
        @classmethod
        def _duration(cls, interval: int | str) -> int | str:
            _check(_interval_problem(interval))
            return interval

        def limit(self) -> tuple[float, int] | None:
            """(seconds per token, burst), or None when the interval is 0 (no limit)."""
            seconds = _interval_seconds(self.interval)
            return (seconds, self.burst) if seconds is not None and seconds > 0 else None

    class _WebConfigModel(_Strict):
        tls_server_config: _TLSModel | None = None
        http_server_config: _HTTPModel | None = None
        basic_auth_users: dict[str, str] | None = None
        rate_limit: _RateLimitModel | None = None

        @field_validator("basic_auth_users")
        @classmethod
        def _bcrypt_hashes(cls, users: dict[str, str] | None) -> dict[str, str] | None:
            _check(_first(_hash_problem(user, hashed) for user, hashed in (users or {}).items()))
            return users

    return _Schema(_WebConfigModel, _TLSModel, _HTTPModel, _RateLimitModel)


def _check(message: str | None) -> None:
    """A broken rule as pydantic's error, so that it is collected with the type errors."""
    if message is not None:
        from pydantic_core import PydanticCustomError

        raise PydanticCustomError(_RULE, "{message}", {"message": message})


def _first(problems: Iterable[str | None]) -> str | None:
    return next((p for p in problems if p is not None), None)


def _tls_settings(raw: Any, base: str) -> TLSSettings:  # raw: a validated tls_server_config
    strings = {k: getattr(raw, k) or "" for k in _TLS_STRINGS}
    for k in _TLS_FILES:
        strings[k] = _join(base, strings[k])
    sans = raw.client_allowed_sans
    return TLSSettings(**strings, cipher_suites=tuple(raw.cipher_suites or ()),
                       curve_preferences=tuple(raw.curve_preferences or ()),
                       min_version=raw.min_version or "TLS12", max_version=raw.max_version or "TLS13",
                       prefer_server_cipher_suites=raw.prefer_server_cipher_suites,
                       client_allowed_sans=None if sans is None else tuple(sans))


def _join(base: str, p: str) -> str:
    """prometheus/common's JoinDir: relative paths are relative to the config file's directory."""
    return p if not p or os.path.isabs(p) else os.path.join(base, p)


# The rules between keys, as exporter-toolkit's ConfigToTLSConfig and Validate check them. Each
# returns the broken rule as one line, or None.


def _tls_one_source_each(tls: TLSSettings) -> str | None:
    for inline, file in (("cert", "cert_file"), ("key", "key_file"), ("client_ca", "client_ca_file")):
        if getattr(tls, inline) and getattr(tls, file):
            return f"{_TLS}: at most one of {inline} and {file} must be configured"
    return None


def _tls_known_names(tls: TLSSettings) -> str | None:
    for i, name in enumerate(tls.cipher_suites):
        if name not in CIPHERS_TLS12 and name not in CIPHERS_TLS13:
            return f"{_TLS}.cipher_suites[{i}]: unknown cipher (Go's tls.CipherSuites() names)"
    for i, name in enumerate(tls.curve_preferences):
        if name not in CURVES:
            return f"{_TLS}.curve_preferences[{i}]: unknown curve (allowed: {', '.join(CURVES)})"
    for key in ("min_version", "max_version"):
        if getattr(tls, key) not in TLS_VERSIONS:
            return f"{_TLS}.{key}: unknown TLS version (allowed: {', '.join(TLS_VERSIONS)})"
    return None


def _tls_certificate(tls: TLSSettings) -> str | None:
    if not tls.enabled:
        return None
    if not (tls.cert_file or tls.cert):
        return f"{_TLS}: missing one of cert or cert_file"
    if not (tls.key_file or tls.key):
        return f"{_TLS}: missing one of key or key_file"
    return None


def _tls_client_auth(tls: TLSSettings) -> str | None:
    auth = tls.client_auth_type
    if not tls.enabled:
        return None
    if auth not in CLIENT_AUTH_TYPES:
        return f"{_TLS}.client_auth_type: invalid ClientAuth (allowed: {', '.join(CLIENT_AUTH_TYPES[1:])})"
    if tls.has_client_ca and auth in ("", "NoClientCert"):
        return f"{_TLS}: client CA's have been configured without a Client Auth Policy"
    if tls.client_allowed_sans is not None and auth not in (
        "RequireAnyClientCert", "RequireClientCert", "RequireAndVerifyClientCert"
    ):
        return (f"{_TLS}: client_allowed_sans requires client_auth_type to be one of "
                "RequireAnyClientCert or RequireAndVerifyClientCert")
    if auth in ("RequireAnyClientCert", "RequireClientCert") and not tls.has_client_ca:
        return (f"{_TLS}: client_auth_type {auth} needs client_ca_file here: Python's ssl "
                "module cannot require a client certificate without verifying it")
    return None


def _tls_version_order(tls: TLSSettings) -> str | None:
    if tls.enabled and TLS_VERSIONS[tls.min_version] > TLS_VERSIONS[tls.max_version]:
        return f"{_TLS}: min_version {tls.min_version} is above max_version {tls.max_version}"
    return None


# Rules for any tls_server_config, then those for one that turns TLS on.
_TLS_RULES: tuple[Callable[[TLSSettings], str | None], ...] = (
    _tls_one_source_each, _tls_known_names, _tls_certificate, _tls_client_auth, _tls_version_order,
)


def _header_problem(name: str, value: str) -> str | None:
    w = "http_server_config.headers"
    if name not in ALLOWED_HEADERS:
        return f'{w}: HTTP header "{name}" can not be configured'
    allowed = ALLOWED_HEADERS[name]
    if allowed is not None and value not in allowed:
        shown = "[" + " ".join(f'"{a}"' for a in allowed) + "]"
        return f"{w}: invalid value for {name}. Expected one of: {shown}"
    if any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in value) or not value.isascii():
        return f"{w}.{name}: value contains control or non-ASCII characters"
    return None


def _hash_problem(user: str, hashed: str) -> str | None:
    m = _BCRYPT_HASH.match(hashed)
    if not m:
        return f"basic_auth_users.{user}: not a bcrypt hash ($2a$, $2b$ or $2y$, cost, 53 characters of salt and hash)"
    if not 4 <= int(m.group(1)) <= 31:
        return f"basic_auth_users.{user}: the bcrypt cost is outside 4..31"
    return None


def _interval_problem(interval: int | str) -> str | None:
    if _interval_seconds(interval) is None:
        return "rate_limit.interval: invalid duration (a Go duration such as 250ms or 1m30s)"
    return None


def _interval_seconds(interval: int | str) -> float | None:
    """A rate_limit interval in seconds, or None if it is not a duration."""
    if isinstance(interval, int):
        return interval * 1e-9  # a bare YAML integer is nanoseconds for a Go time.Duration
    try:
        return parse_go_duration(interval)
    except ValueError:
        return None


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


# What a wrong type is called in an error (pydantic's error types; never the value, never a class).
_EXPECTED = {
    "model_type": "expected a mapping", "model_attributes_type": "expected a mapping", "dict_type": "expected a mapping",
    "string_type": "expected a string", "bool_type": "expected true or false", "list_type": "expected a list of strings",
    "int_type": "expected an integer", "greater_than_equal": "expected a non-negative integer",
}


def _schema_error(errors: list[Any], schema: _Schema) -> WebConfigError:
    """The error to report, as one line: a wrong key or type first (as exporter-toolkit, which
    checks the rules between keys only once the file unmarshals), else the first broken rule in
    the order of ``_RULE_ORDER``."""
    wrong = [e for e in errors if e["type"] != _RULE]
    if not wrong:
        rule = min(errors, key=lambda e: _RULE_ORDER.index(e["loc"][0]))
        return WebConfigError(rule["msg"])
    return WebConfigError(_type_problem(wrong[0], schema))


def _type_problem(error: Any, schema: _Schema) -> str:
    """One pydantic error of a key or type: the dotted key and the reason."""
    loc = [str(p) for p in error["loc"] if p != "[key]"]
    if error["loc"] and error["loc"][-1] == "[key]":
        return f"{'.'.join(loc[:-1]) or 'top level'}: a key is not a string (quote it)"
    # A union (int | str) reports each member; the type names are pydantic's, so name the field only.
    loc = [p for p in loc if p not in ("int", "str")]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        model = schema.root
        for part in loc[:-1]:
            model = schema.section(part)
        return f"unknown key '{key}' (allowed: {', '.join(model.model_fields)})"
    return f"{key or 'top level'}: {_type_reason(loc, error['type'])}"


def _type_reason(loc: list[str], kind: str) -> str:
    if loc[:1] == ["basic_auth_users"] and len(loc) == 2 and kind == "string_type":
        return "expected a bcrypt hash string"
    if loc == ["rate_limit", "interval"]:
        return "expected a duration such as 1s"
    return _EXPECTED.get(kind, "not valid here")


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
    """The file's text, read by :func:`exporter.files.read_text`: a regular file only, opened
    without blocking, at most 1 MiB. A reload runs on the serving loop: a FIFO or a device put in
    the file's place is refused at once (fail closed), never waited on."""
    try:
        return read_text(path, MAX_FILE_BYTES)
    except FileReadError as exc:
        raise WebConfigError(f"web config {exc}") from None
