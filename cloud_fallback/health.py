"""How healthy the cloud is: a circuit breaker over request outcomes, and heartbeats.

`CircuitBreaker` counts consecutive failures (unreachable, stalled, errors). At
`failures_to_open` it opens: the router sends nothing to the cloud for
`cooldown_s`. Then it is half-open: one request (or heartbeat) may try; a
success closes it, a failure opens it again for another cooldown.

Heartbeats are WebSocket pings on the client's connection (`CloudBackend`
sends them on an interval while connected); each answered ping counts as a
success and records the round trip, each unanswered one as a failure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class CircuitBreaker:
    failures_to_open: int = 3
    cooldown_s: float = 30.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0  # consecutive
    opened_at: float | None = None
    last_error: str = ""
    rtt_ms: float | None = None  # the last heartbeat's round trip
    history: list = field(default_factory=list)  # (time, "ok" | error), the last few, for /metrics and reasons

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        return OPEN if self.clock() - self.opened_at < self.cooldown_s else HALF_OPEN

    def allow(self) -> bool:
        """May a request go to the cloud now? (closed, or half-open: a trial)"""
        return self.state != OPEN

    def record_success(self, rtt_ms: float | None = None) -> None:
        self.failures, self.opened_at = 0, None
        if rtt_ms is not None:
            self.rtt_ms = rtt_ms
        self._note("ok")

    def record_failure(self, error: str) -> None:
        self.failures += 1
        self.last_error = error
        if self.failures >= self.failures_to_open or self.state == HALF_OPEN:
            self.opened_at = self.clock()
        self._note(error)

    def describe(self) -> str:
        state = self.state
        if state == OPEN:
            left = self.cooldown_s - (self.clock() - self.opened_at)
            return (f"cloud circuit open after {self.failures} consecutive failures (last: {self.last_error}); "
                    f"next try in {left:.0f} s")
        if state == HALF_OPEN:
            return "cloud circuit half-open: one trial request"
        rtt = f", heartbeat {self.rtt_ms:.1f} ms" if self.rtt_ms is not None else ""
        return f"cloud healthy ({self.failures} recent failures{rtt})"

    def _note(self, what: str) -> None:
        self.history.append((self.clock(), what))
        del self.history[:-20]
