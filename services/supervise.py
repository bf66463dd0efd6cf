"""Keep `mooncake up`'s child processes running, as a process manager does.

A child that exits is started again with the same arguments (so the same ports and the same
instance or node id: the Conductor's poll and the store master's re-registration take it back)
after a backoff that doubles from `initial_backoff_s` up to `max_backoff_s`, and falls back to
the initial one once a child has stayed up `reset_after_s`. A child that exits more than
`max_restarts` times within `window_s`, or more than `max_restarts` times in a row each time
before `reset_after_s` (a child that takes long to fail, such as one that loads a model before
binding its port, may never fit that many exits into the window) is in a crash loop:
restarting it again only hides the problem, so the supervisor gives up and `mooncake up` stops
everything, naming the child, its exit status and the end of its log.

The policy is pure functions over an immutable `ChildHistory` (tests drive them with a fake
clock); `Supervisor` applies it to anything shaped like a `Child`. `mooncake up` (`up.py`) is
the only caller that owns real processes.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    """Wait before the first restart: long enough not to spin on a child that dies at once,
    short enough that a one-off crash costs no more than the child's own start time."""
    max_backoff_s: float = 10.0
    """The backoff doubles per consecutive crash up to this cap (seconds)."""
    reset_after_s: float = 30.0
    """A child that stayed up this long (seconds) crashed for a new reason: its next restart
    starts again from `initial_backoff_s`, and its earlier short runs no longer count."""
    max_restarts: int = 5
    """Restarts allowed within `window_s`, and in a row after runs shorter than
    `reset_after_s`; one more exit is a crash loop. 0 restarts nothing: the first exit of any
    child stops everything (the behaviour before supervision)."""
    window_s: float = 120.0
    """The sliding window (seconds) in which exits are counted for the crash-loop limit."""

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoff must satisfy 0 <= initial_backoff_s <= max_backoff_s")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("max_restarts must be >= 0 and window_s > 0")


@dataclass(frozen=True)
class ChildHistory:
    """What the policy needs to know about one child's past; replaced, never mutated."""

    started_at: float
    exits: tuple[float, ...] = ()
    """When the child exited, inside the crash-loop window only."""
    backoff_s: float = 0.0
    """The delay before the latest restart (0: never restarted, or reset)."""
    short_exits: int = 0
    """Consecutive exits of runs shorter than `reset_after_s`."""
    restarts: int = 0
    """Restarts since `mooncake up` began (the counter in the status output)."""


@dataclass(frozen=True)
class Restart:
    delay_s: float


@dataclass(frozen=True)
class CrashLoop:
    reason: str
    """What follows the child's name, e.g. `is crash-looping: it exited 6 times within 120s`."""


Decision = Restart | CrashLoop


def next_backoff(policy: RestartPolicy, history: ChildHistory, now: float) -> float:
    """Double the previous delay, capped; the initial one after a long enough run."""
    if history.backoff_s <= 0 or now - history.started_at >= policy.reset_after_s:
        return policy.initial_backoff_s
    return min(history.backoff_s * 2, policy.max_backoff_s)


def on_exit(policy: RestartPolicy, history: ChildHistory, now: float
            ) -> tuple[Decision, ChildHistory]:
    """The decision for a child that exited at `now`, and its history with that exit."""
    exits = (*(t for t in history.exits if now - t < policy.window_s), now)
    short = now - history.started_at < policy.reset_after_s
    history = replace(history, exits=exits, short_exits=history.short_exits + 1 if short else 0)
    if policy.max_restarts == 0:
        return CrashLoop("exited and restarts are off (max_restarts=0)"), history
    if len(exits) > policy.max_restarts:
        return CrashLoop(f"is crash-looping: it exited {len(exits)} times within "
                         f"{policy.window_s:.0f}s"), history
    if history.short_exits > policy.max_restarts:
        return CrashLoop(f"is crash-looping: it exited {history.short_exits} times in a row, "
                         f"each time within {policy.reset_after_s:.0f}s of its start"), history
    delay = next_backoff(policy, history, now)
    return Restart(delay), replace(history, backoff_s=delay)


def on_restart(history: ChildHistory, now: float) -> ChildHistory:
    return replace(history, started_at=now, restarts=history.restarts + 1)


def describe_exit(returncode: int) -> str:
    """`exit code 3` or `signal SIGKILL` (Popen reports a signal as a negative code)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class Child(Protocol):
    """One supervised process: `up.py` adapts `LocalCluster`'s processes to this."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None:
        """The exit status once the process has exited (reaped), else None."""

    def restart(self) -> None:
        """Start the process again with the same arguments (same identity)."""

    def log_tail(self) -> str:
        """The last lines of its log, for the crash-loop message."""


class CrashLoopError(RuntimeError):
    """A child exited too often: the whole system should stop."""

    def __init__(self, name: str, status: str, reason: str, tail: str) -> None:
        self.child = name
        self.status = status
        super().__init__(f"{name} {reason} (last: {status}); giving up. "
                         f"Last log lines of {name}:\n{tail}")


@dataclass
class _Entry:
    child: Child
    history: ChildHistory
    last_exit: str = ""
    restart_at: float | None = None
    pids: list[int] = field(default_factory=list)


class Supervisor:
    """Restarts children per `RestartPolicy`. Call `step()` periodically from one thread;
    it raises `CrashLoopError` when a child is in a crash loop."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] | None = None) -> None:
        self.policy = policy
        self.clock = clock
        self.on_change = on_change
        self._entries: dict[str, _Entry] = {}

    def add(self, child: Child) -> None:
        self._entries[child.name] = _Entry(child, ChildHistory(started_at=self.clock()),
                                           pids=[child.pid])

    def step(self) -> None:
        changed = False
        for e in self._entries.values():
            now = self.clock()
            if e.restart_at is not None:
                if now >= e.restart_at:
                    self._restart(e, now)
                    changed = True
                continue
            rc = e.child.poll()
            if rc is None:
                continue
            changed = True
            e.last_exit = describe_exit(rc)
            decision, e.history = on_exit(self.policy, e.history, now)
            if isinstance(decision, CrashLoop):
                log.error("%s %s (last: %s); stopping everything", e.child.name,
                          decision.reason, e.last_exit)
                self._notify()
                raise CrashLoopError(e.child.name, e.last_exit, decision.reason,
                                     e.child.log_tail())
            e.restart_at = now + decision.delay_s
            log.warning("%s (pid %d) exited with %s; restarting in %.1fs (restart %d)",
                        e.child.name, e.child.pid, e.last_exit, decision.delay_s,
                        e.history.restarts + 1)
        if changed:
            self._notify()

    def _restart(self, e: _Entry, now: float) -> None:
        e.child.restart()
        e.history = on_restart(e.history, now)
        e.restart_at = None
        e.pids.append(e.child.pid)
        log.info("%s restarted (pid %d, restart %d)", e.child.name, e.child.pid,
                 e.history.restarts)

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def restarts(self) -> dict[str, int]:
        return {name: e.history.restarts for name, e in self._entries.items()}

    def status(self) -> dict[str, dict[str, object]]:
        """Per child: state, pid, restart count, last exit and every pid it ever had (a test
        checks none outlives `mooncake up`)."""
        out: dict[str, dict[str, object]] = {}
        for name, e in self._entries.items():
            out[name] = {
                "state": "backoff" if e.restart_at is not None else "running",
                "pid": e.child.pid, "restarts": e.history.restarts,
                "last_exit": e.last_exit or None, "pids": list(e.pids),
            }
        return out
