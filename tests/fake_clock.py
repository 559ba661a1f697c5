"""A clock that tests move by hand, so nothing sleeps (inject it where code takes `clock=`)."""

from __future__ import annotations


class FakeClock:
    """Return a time that moves only when a test advances it."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`."""
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds
