"""Basic auth and the request rate limit of a web config (``basic_auth_users``, ``rate_limit``).

* Basic auth: values are bcrypt hashes (``$2a$``, ``$2b$``, ``$2y$``). An unknown user is checked
  against a fixed fake hash, so response timing does not reveal which users exist. Results are
  cached per (user, hash, password); bcrypt (~60 ms at cost 10) runs in **one** worker thread,
  never on the serving loop. A flood of wrong passwords therefore queues there (bounded) while a
  scrape with the right password is answered from the cache.
* The rate limit is a token bucket like Go's ``rate.Limiter``, as exporter-toolkit applies it:
  one bucket for all requests.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

__all__ = ["FAKE_HASH", "Authenticator", "RateLimiter", "parse_basic_auth"]

# bcrypt("fakepassword", cost 10): unknown users are checked against it so they cost the same time.
FAKE_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"


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
