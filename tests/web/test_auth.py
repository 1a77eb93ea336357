"""Basic auth's password checks (``exporter/web/auth.py``) driven directly on an event loop: what a
flood of wrong passwords may cost in bcrypt work, and what a right password waits for.

Each check's CPU seconds come from a counter standing in for ``time.thread_time`` (0.05 s a
check, whatever bcrypt really took), so the budgets bind after a few checks and the figures are
exact; bcrypt itself runs for real on cost-4 hashes (~1 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import bcrypt

from exporter.web.auth import Authenticator

USERS = {b"prometheus": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4))}
CHECK = 0.05  # the CPU seconds each check is said to take


def _fake_thread_time():
    """Called twice per check, at its start and its end, by the one worker thread."""
    ticks = itertools.count()
    return lambda: next(ticks) * CHECK


def _authenticator(**kwargs) -> Authenticator:
    return Authenticator(thread_time=_fake_thread_time(), **kwargs)


async def _guess(auth: Authenticator, peer: str, n: int, done: list[tuple[str, float]]) -> None:
    for i in range(n):
        verdict = await auth.check(USERS, b"prometheus", f"guess-{peer}-{i}".encode(), peer=peer)
        assert verdict is False
        done.append((peer, time.monotonic()))


def test_the_bcrypt_work_of_failures_is_bounded_per_address_and_in_all() -> None:
    """Two addresses guess as fast as they are answered for 2 s. Each stays within its own budget
    (0.2 s burst + 0.2 of a core), both together within the global one (0.3 s + 0.3 of a core),
    and the guesses are slowed down to it rather than refused: the work done is about the bound."""
    auth = _authenticator(peer_share=0.2, peer_burst=0.2, failure_share=0.3, failure_burst=0.3)
    done: list[tuple[str, float]] = []

    async def main() -> float:
        started = time.monotonic()
        tasks = [asyncio.create_task(_guess(auth, peer, 1000, done)) for peer in ("10.0.0.1", "10.0.0.2")]
        await asyncio.sleep(2.0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return time.monotonic() - started

    try:
        elapsed = asyncio.run(main())
    finally:
        auth.close()
    per_peer = {peer: sum(1 for p, _ in done if p == peer) for peer in ("10.0.0.1", "10.0.0.2")}
    for count in per_peer.values():
        assert count * CHECK <= 0.2 + 0.2 * elapsed + CHECK, per_peer
    total = len(done)
    assert total * CHECK <= 0.3 + 0.3 * elapsed + CHECK
    assert abs(auth.failure_seconds - total * CHECK) < 2 * CHECK + 1e-9  # a cancelled one may have run too
    assert total * CHECK >= 0.3 + 0.3 * (elapsed - 0.5)  # paced to the budget, not stopped
    assert min(per_peer.values()) >= total // 2 - 2  # round-robin: an even share


def test_a_right_password_gets_its_turn_during_a_flood_and_is_let_in_at_once_afterwards() -> None:
    """While one address floods (its budget and the global one spent), the right password from
    another address gets a check at the next turn; once it passed, it is let in without bcrypt,
    from any address, however many checks wait."""
    auth = _authenticator(peer_share=0.2, peer_burst=0.1, failure_share=0.2, failure_burst=0.1)
    done: list[tuple[str, float]] = []

    async def main() -> tuple[float, list[bool], int]:
        flood = [asyncio.create_task(_guess(auth, "10.0.0.1", 1000, done)) for _ in range(16)]
        await asyncio.sleep(0.5)  # the budgets are spent: checks run at 0.2 of a core, one per 0.25 s
        assert auth._pending >= 8
        t = time.monotonic()
        first = await auth.check(USERS, b"prometheus", b"s3cret", peer="10.0.0.9")
        waited = time.monotonic() - t
        runs = auth.bcrypt_runs
        again = [await auth.check(USERS, b"prometheus", b"s3cret", peer=peer) for peer in ("10.0.0.9", "10.0.0.1", "::1")]
        assert auth.bcrypt_runs == runs  # verified: no bcrypt, not even on the flooding address
        assert first is True
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        for _ in range(100):  # the check running when they went away still ends
            if not auth._pending:
                break
            await asyncio.sleep(0.01)
        return waited, again, auth._pending

    try:
        waited, again, pending = asyncio.run(main())
    finally:
        auth.close()
    assert waited < 1.0, waited  # one turn (~0.25 s at this budget), not the 16 guesses queued before it
    assert again == [True, True, True]
    assert pending == 0  # nothing left waiting once the clients went away


def test_a_repeated_wrong_password_costs_one_check() -> None:
    auth = _authenticator()

    async def main() -> list[bool | None]:
        return [await auth.check(USERS, b"prometheus", b"old-password", peer="10.0.0.1") for _ in range(5)]

    try:
        assert asyncio.run(main()) == [False] * 5
    finally:
        auth.close()
    assert auth.bcrypt_runs == 1


def test_a_check_that_cannot_start_in_time_is_refused_and_leaves_no_trace() -> None:
    """Past ``max_wait`` without a turn (the budget spent), a check is refused (the server says
    429) and gives up its place; too many waiting for one address are refused at once."""
    auth = _authenticator(peer_share=0.01, peer_burst=0.01, max_wait=0.3, max_pending_per_peer=3)

    async def main() -> list[bool | None]:
        first = await auth.check(USERS, b"prometheus", b"wrong", peer="10.0.0.1")  # spends the budget
        waiting = [asyncio.create_task(auth.check(USERS, b"prometheus", f"w{i}".encode(), peer="10.0.0.1")) for i in range(4)]
        await asyncio.sleep(0)
        refused_at_once = waiting[3].done() and waiting[3].result() is None
        verdicts = [first, *(await asyncio.gather(*waiting))]
        assert refused_at_once
        assert auth._pending == 0 and not auth._lanes
        return verdicts

    try:
        assert asyncio.run(main()) == [False, None, None, None, None]
    finally:
        auth.close()
    assert auth.bcrypt_runs == 1
