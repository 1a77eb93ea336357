"""Background work that steps aside while the node changes.

CPython runs one thread's Python at a time. While a background thread works (the usage thread's
passes and the ledger's render, the scratch watcher's safety-net rescans: tens to hundreds of
milliseconds at 10,000 kernels), a kernel change's path (the watcher's refresh, the allocation
pass, the clients that read the result) waits for the interpreter again and again and takes up to
~3 times as long (BENCHMARKS.md i10, i11). That work loses nothing by running a little later: usage
figures integrate over the time that passed, and a rescan is a safety net behind the events. So at
the boundaries of its work a background thread asks :meth:`Foreground.step_aside`, which waits
while changes keep coming, within a bound per pass so that work still runs on a node whose
kernels never stop changing.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ASIDE_AT_MOST_SECONDS", "QUIET_SECONDS", "Foreground"]

# A background pass starts (or goes on) only after this many seconds without a change: longer than
# one change's path at 10,000 kernels (~5 ms) and than the gaps in a burst of them, short beside a
# usage interval (5 s) or a rescan interval (60 s).
QUIET_SECONDS = 0.05
# ...and waits so at most this many seconds per pass.
ASIDE_AT_MOST_SECONDS = 1.0


class Foreground:
    """Changes seen by one thread, stepped aside from by another.

    :param wait: waits the seconds given and returns True where the waiting thread is stopping
        (``threading.Event.wait`` of its stop event): it then waits no more.
    """

    def __init__(self, wait: Callable[[float], bool], quiet: float = QUIET_SECONDS,
                 at_most: float = ASIDE_AT_MOST_SECONDS) -> None:
        self._quiet, self._at_most, self._wait = quiet, at_most, wait
        self._changes = 0  # moved by each change (from one thread at a time: the book's lock, the event reader)
        self._seen = 0  # ``_changes`` when the background thread last looked
        self._left = at_most  # seconds the current pass may still wait

    def changed(self) -> None:
        """A change arrived (cheap: one increment)."""
        self._changes += 1

    def seen(self) -> None:
        """Every change so far needs no stepping aside (those a start has already handled)."""
        self._seen = self._changes

    def begin(self, at_most: float | None = None) -> None:
        """A new pass: it may wait ``at_most`` seconds again (None: the bound it was made with)."""
        self._left = self._at_most if at_most is None else at_most

    def step_aside(self) -> None:
        """Return once ``quiet`` seconds pass without a change since the last look (at once where
        none came), or when the pass's waiting is spent."""
        while self._changes != self._seen and self._left > 0.0:
            self._seen = self._changes
            wait = min(self._quiet, self._left)
            self._left -= wait
            if self._wait(wait):
                return
