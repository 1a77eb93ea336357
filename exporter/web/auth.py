"""Basic auth and the request rate limit of a web config (``basic_auth_users``, ``rate_limit``).

* Basic auth: values are bcrypt hashes (``$2a$``, ``$2b$``, ``$2y$``). An unknown user is checked
  against a fixed fake hash, so response timing does not reveal which users exist. bcrypt (~60 ms
  at cost 10) runs in **one** worker thread, never on the serving loop. A password that passed is
  remembered (a keyed digest per user and hash, compared in constant time) and let in at once
  ever after, whatever else is waiting; the bcrypt work spent on wrong passwords is bounded per
  client address and in all (:class:`Authenticator`).
* The rate limit is a token bucket like Go's ``rate.Limiter``, as exporter-toolkit applies it:
  one bucket for all requests.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

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


class _Budget:
    """Seconds of bcrypt work as a token bucket: ``share`` of one core on average, after a burst
    of ``burst`` seconds. A check may start while any budget is left; what a failed check took is
    charged after it (so the budget may go below zero by one check)."""

    __slots__ = ("share", "burst", "_tokens", "_at")

    def __init__(self, share: float, burst: float, now: float) -> None:
        self.share, self.burst = share, burst
        self._tokens, self._at = burst, now

    def _refill(self, now: float) -> float:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.share)
        self._at = now
        return self._tokens

    def wait(self, now: float) -> float:
        """Seconds until a check may start (0: now)."""
        tokens = self._refill(now)
        return 0.0 if tokens > 0 else (1e-3 - tokens) / self.share

    def charge(self, seconds: float, now: float) -> None:
        self._tokens = self._refill(now) - seconds


@dataclass(eq=False)
class _Check:
    """A password waiting for, or in, the bcrypt worker."""

    user: bytes
    hashed: bytes
    password: bytes
    known: bool  # the user exists (else ``hashed`` is the fake hash)
    peer: str
    future: asyncio.Future
    expiry: asyncio.TimerHandle | None = field(default=None, repr=False)


class Authenticator:
    """bcrypt checks in one worker thread, never on the event loop: verified passwords first,
    failures bounded, waiting checks fair across client addresses.

    * **Verified first.** A password that passed is kept as a keyed digest (HMAC-SHA-256 with a
      key made at start) under its user and hash, and a presented password is compared with those
      digests (constant time) before anything else: a scraper that got in once is let in at once,
      however many checks wait, from whatever address. Only a correct password can enter this
      cache, so no flood evicts it; a changed hash in the config makes it miss.
    * **Known failures.** A wrong password is remembered too (LRU of keyed digests), so a client
      that repeats one (a stale password in a scrape config) costs no bcrypt.
    * **Everything else waits its turn**: per client address in arrival order, the worker taking
      addresses round-robin, so a flood from one address delays a first login from another by one
      check per busy address. A first login from the flooding address itself waits behind that
      address's checks (at most ``max_pending_per_peer``; 429 beyond, or after ``max_wait``
      seconds without starting).
    * **Failures' bcrypt work is bounded** as seconds of one core: per address, ``peer_share`` on
      average after a burst of ``peer_burst`` seconds; for all addresses together,
      ``failure_share`` after ``failure_burst``. A check starts only while both budgets of its
      address have some left, and what it took is charged only if it failed: a flood of guesses
      slows down to the budget instead of being turned away, so the right password in among
      them still gets its check within seconds. The defaults keep a guessing flood to three
      quarters of a core: with 64 guessing connections on the scraper's own address and cost-10
      hashes (~75 ms), the scraper's first login waits ~5 s while the burst lasts and ~6.5 s after
      it, within Prometheus's default 10 s scrape timeout (a flood of more connections from that
      very address can still outwait it: nothing tells its guesses from the scraper's login).

    Passwords are compared as Go's ``bcrypt.CompareHashAndPassword`` does (exporter-toolkit): only
    the first 72 bytes count, so a hash made by a tool that truncated a longer password matches.

    :param monotonic: seconds, for the budgets; ``thread_time`` measures a check's CPU seconds.
    """

    def __init__(self, *, max_pending_per_peer: int = 128, max_pending: int = 1024, max_wait: float = 10.0,
                 peer_share: float = 0.75, peer_burst: float = 4.0, failure_share: float = 0.75, failure_burst: float = 8.0,
                 verified_size: int = 256, failures_size: int = 1024, max_peers: int = 4096,
                 monotonic: Callable[[], float] = time.monotonic,
                 thread_time: Callable[[], float] = time.thread_time) -> None:
        self.max_pending_per_peer, self.max_pending, self.max_wait = max_pending_per_peer, max_pending, max_wait
        self.peer_share, self.peer_burst = peer_share, peer_burst
        self.verified_size, self.failures_size, self.max_peers = verified_size, failures_size, max_peers
        self._monotonic, self._thread_time = monotonic, thread_time
        self._key = secrets.token_bytes(32)  # the caches hold keyed digests, never passwords
        # hmac(user, hash) -> digests of the passwords that passed for them, most recent last.
        self._verified: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._failures: OrderedDict[bytes, None] = OrderedDict()  # digests of (user, hash, password) that failed
        self._lanes: OrderedDict[str, deque[_Check]] = OrderedDict()  # peer -> waiting checks, round-robin
        self._budget = _Budget(failure_share, failure_burst, monotonic())
        self._peer_budgets: OrderedDict[str, _Budget] = OrderedDict()
        self._pending = 0  # checks waiting or running
        self._running = False
        self._timer: asyncio.TimerHandle | None = None  # wakes the worker when a budget refills
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.bcrypt_runs = 0
        self.failure_seconds = 0.0  # CPU seconds of checks that failed (what the budgets bound)

    # -- the caches -------------------------------------------------------------------------------

    def _digest(self, *parts: bytes) -> bytes:
        return hmac.new(self._key, b"\x00".join(base64.b64encode(p) for p in parts), hashlib.sha256).digest()

    def verified(self, users: Mapping[bytes, bytes], user: bytes, password: bytes) -> bool:
        """Whether this password passed for this user and hash before (no bcrypt)."""
        hashed = users.get(user)
        if hashed is None:
            return False
        slot = self._digest(user, hashed)
        with self._lock:
            digests = self._verified.get(slot, ())
        presented = self._digest(user, hashed, password)
        return any([hmac.compare_digest(presented, d) for d in digests])  # a list: every digest compared

    def _remember_verified(self, user: bytes, hashed: bytes, password: bytes) -> None:
        slot = self._digest(user, hashed)
        with self._lock:
            digests = (*self._verified.pop(slot, ())[-3:], self._digest(user, hashed, password))
            self._verified[slot] = digests
            while len(self._verified) > self.verified_size:
                self._verified.popitem(last=False)

    def _known_failure(self, user: bytes, hashed: bytes, password: bytes) -> bool:
        key = self._digest(user, hashed, password)
        with self._lock:
            if key in self._failures:
                self._failures.move_to_end(key)
                return True
        return False

    def _remember_failure(self, user: bytes, hashed: bytes, password: bytes) -> None:
        with self._lock:
            self._failures[self._digest(user, hashed, password)] = None
            while len(self._failures) > self.failures_size:
                self._failures.popitem(last=False)

    # -- checks -----------------------------------------------------------------------------------

    async def check(self, users: Mapping[bytes, bytes], user: bytes, password: bytes, peer: str = "") -> bool | None:
        """Verify a login from address ``peer``; None means refused for now (too many checks
        waiting for that address or in all, or none could start within ``max_wait``)."""
        if self.verified(users, user, password):
            return True
        known = user in users
        hashed = users.get(user, FAKE_HASH)
        if self._known_failure(user, hashed, password):
            return False
        lane = self._lanes.get(peer)
        if self._pending >= self.max_pending or (lane is not None and len(lane) >= self.max_pending_per_peer):
            return None
        loop = asyncio.get_running_loop()
        item = _Check(user, hashed, password, known, peer, loop.create_future())
        item.expiry = loop.call_later(self.max_wait, self._expire, item)
        if lane is None:
            lane = self._lanes[peer] = deque()
        lane.append(item)
        self._pending += 1
        self._next()
        try:
            return await item.future
        except asyncio.CancelledError:  # the client went away: its place goes too (a check running ends)
            self._withdraw(item)
            raise

    def _withdraw(self, item: _Check) -> bool:
        """Take a check that has not started out of its lane; False if it is not waiting there."""
        lane = self._lanes.get(item.peer)
        if lane is None or item not in lane:
            return False
        lane.remove(item)
        if not lane:
            del self._lanes[item.peer]
        self._drop(item)
        return True

    def _expire(self, item: _Check) -> None:
        """A check that has not started within ``max_wait``: refused (429), its place given up."""
        if self._withdraw(item) and not item.future.done():
            item.future.set_result(None)

    def _peer_budget(self, peer: str) -> _Budget:
        budget = self._peer_budgets.get(peer)
        if budget is None:
            budget = self._peer_budgets[peer] = _Budget(self.peer_share, self.peer_burst, self._monotonic())
            while len(self._peer_budgets) > self.max_peers:
                self._peer_budgets.popitem(last=False)
        return budget

    def _next(self) -> None:
        """Start the next check: the oldest of the first address (round-robin) whose budget allows
        one; when no budget does, wake up when the first one will."""
        if self._running or self._timer is not None:
            return
        now = self._monotonic()
        soonest = self._budget.wait(now)
        if soonest == 0.0:
            soonest = math.inf
            for peer in list(self._lanes):
                lane = self._lanes[peer]
                while lane and lane[0].future.done():  # its connection went away while it waited
                    self._drop(lane.popleft())
                if not lane:
                    del self._lanes[peer]
                    continue
                wait = self._peer_budget(peer).wait(now)
                if wait > 0.0:
                    soonest = min(soonest, wait)
                    continue
                item = lane.popleft()
                if lane:
                    self._lanes.move_to_end(peer)
                else:
                    del self._lanes[peer]
                self._start(item)
                return
        if self._lanes and soonest < math.inf:
            self._timer = asyncio.get_running_loop().call_later(soonest, self._wake)

    def _wake(self) -> None:
        self._timer = None
        self._next()

    def _drop(self, item: _Check) -> None:
        if item.expiry is not None:
            item.expiry.cancel()
        self._pending -= 1

    def _start(self, item: _Check) -> None:
        if item.expiry is not None:
            item.expiry.cancel()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bcrypt")
        self._running = True
        job = asyncio.get_running_loop().run_in_executor(self._executor, self._bcrypt, item.hashed, item.password)
        job.add_done_callback(lambda job: self._done(job, item))

    def _done(self, job: asyncio.Future, item: _Check) -> None:
        self._running = False
        self._pending -= 1
        ok, seconds = (False, 0.0) if job.cancelled() or job.exception() is not None else job.result()
        passed = ok and item.known
        if passed:
            self._remember_verified(item.user, item.hashed, item.password)
        else:
            self._remember_failure(item.user, item.hashed, item.password)
            now = self._monotonic()
            self._budget.charge(seconds, now)
            self._peer_budget(item.peer).charge(seconds, now)
            self.failure_seconds += seconds
        if not item.future.done():
            item.future.set_result(passed)
        self._next()

    def _bcrypt(self, hashed: bytes, password: bytes) -> tuple[bool, float]:
        """(whether it matches, CPU seconds the check took)."""
        import bcrypt

        self.bcrypt_runs += 1
        started = self._thread_time()
        try:
            # Go's CompareHashAndPassword keys Blowfish with the first 72 bytes only; bcrypt 5 raises
            # on longer passwords instead of truncating.
            ok = bcrypt.checkpw(password[:72], hashed)
        except ValueError:  # a malformed salt
            ok = False
        return ok, self._thread_time() - started

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
