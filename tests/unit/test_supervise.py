"""The restart policy of `mooncake up` (`supervise`), driven by a fake clock.

The policy functions are pure; the `Supervisor` is exercised with scripted children (a
stand-in for a process: an exit status when asked, a new pid when restarted) so that every
timing is exact and no test sleeps.
"""

from __future__ import annotations

import logging

import pytest

from mooncake_k8s.supervise import (
    ChildHistory,
    CrashLoop,
    CrashLoopError,
    Restart,
    RestartPolicy,
    Supervisor,
    describe_exit,
    next_backoff,
    on_exit,
    on_restart,
)

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, reset_after_s=30.0,
                       max_restarts=5, window_s=60.0)


def _crash_at(times: list[float], policy: RestartPolicy = POLICY
              ) -> list[Restart | CrashLoop]:
    """Exit at each time (restarting right after the backoff) and collect the decisions."""
    h = ChildHistory(started_at=0.0)
    out: list[Restart | CrashLoop] = []
    for t in times:
        d, h = on_exit(policy, h, t)
        out.append(d)
        if isinstance(d, Restart):
            h = on_restart(h, t + d.delay_s)
    return out


def test_backoff_doubles_from_initial_to_the_cap() -> None:
    p = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, max_restarts=100, window_s=60)
    delays = [d.delay_s for d in _crash_at([1.0 + i for i in range(7)], p)
              if isinstance(d, Restart)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_backoff_resets_after_the_child_stayed_up() -> None:
    h = ChildHistory(started_at=100.0, backoff_s=4.0, restarts=3)
    assert next_backoff(POLICY, h, now=100.0 + 29.9) == 4.0  # capped, still crashing fast
    assert next_backoff(POLICY, h, now=100.0 + 30.0) == 0.5  # stayed up reset_after_s


def test_crash_loop_after_max_restarts_within_the_window() -> None:
    decisions = _crash_at([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert all(isinstance(d, Restart) for d in decisions[:5])
    assert decisions[5] == CrashLoop("is crash-looping: it exited 6 times within 60s")


def test_exits_outside_the_window_are_forgotten() -> None:
    # Eight exits, but never more than five within any 60 s, and the runs are long (over
    # reset_after_s) except one: never a crash loop.
    p = RestartPolicy(max_restarts=5, window_s=60, reset_after_s=3.0)
    decisions = _crash_at([0.0, 20.0, 40.0, 55.0, 59.0, 61.0, 81.0, 101.0], p)
    assert all(isinstance(d, Restart) for d in decisions), decisions


def test_a_child_that_fails_slowly_is_a_crash_loop_too() -> None:
    """Each run lasts 25 s (a model load, then the failure): never more than three exits in
    the 60 s window, but six short runs in a row."""
    decisions = _crash_at([25.0 * (i + 1) for i in range(6)])
    assert all(isinstance(d, Restart) for d in decisions[:5]), decisions
    assert decisions[5] == CrashLoop("is crash-looping: it exited 6 times in a row, each time "
                                     "within 30s of its start")


def test_a_long_run_forgets_the_short_ones() -> None:
    h = ChildHistory(started_at=0.0)
    for t in (10.0, 20.0, 30.0):
        _, h = on_exit(POLICY, h, t)
        h = on_restart(h, t)
    assert h.short_exits == 3
    _, h = on_exit(POLICY, h, 100.0)  # up 70 s
    assert h.short_exits == 0


def test_zero_restarts_stops_at_the_first_exit() -> None:
    p = RestartPolicy(max_restarts=0)
    d, _ = on_exit(p, ChildHistory(started_at=0.0), 5.0)
    assert d == CrashLoop("exited and restarts are off (max_restarts=0)")


def test_restart_counter_counts_every_restart() -> None:
    h = ChildHistory(started_at=0.0)
    for i in range(3):
        _, h = on_exit(POLICY, h, 10.0 * i + 1)
        h = on_restart(h, 10.0 * i + 2)
    assert h.restarts == 3 and h.started_at == 22.0


@pytest.mark.parametrize(("kw", "field"), [
    ({"initial_backoff_s": -1}, "backoff"), ({"initial_backoff_s": 5, "max_backoff_s": 1},
                                             "backoff"),
    ({"max_restarts": -1}, "max_restarts"), ({"window_s": 0}, "window_s")])
def test_bad_policy_names_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**kw)  # type: ignore[arg-type]


def test_describe_exit() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-15) == "signal SIGTERM"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedChild:
    """Exits with the next scripted status each time the test says it died."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = 100
        self.exit: int | None = None
        self.starts = 0

    def poll(self) -> int | None:
        return self.exit

    def restart(self) -> None:
        assert self.exit is not None, "restarted while still running"
        self.exit = None
        self.pid += 1
        self.starts += 1

    def log_tail(self) -> str:
        return "OSError: [Errno 98] Address already in use"


def test_supervisor_restarts_after_the_backoff_and_logs_it(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    changes: list[dict[str, int]] = []
    sup = Supervisor(POLICY, clock=clock)
    sup.on_change = lambda: changes.append(sup.restarts())
    a, b = ScriptedChild("decode-0"), ScriptedChild("prefill-0")
    sup.add(a)
    sup.add(b)
    caplog.set_level(logging.INFO, logger="mooncake_k8s.supervise")
    sup.step()
    assert a.starts == 0 and changes == []

    a.exit = -9
    sup.step()
    assert a.starts == 0  # waiting out the backoff
    assert sup.status()["decode-0"]["state"] == "backoff"
    assert "decode-0 (pid 100) exited with signal SIGKILL; restarting in 0.5s" in caplog.text
    clock.now += 0.49
    sup.step()
    assert a.starts == 0
    clock.now += 0.01
    sup.step()
    assert a.starts == 1 and b.starts == 0
    assert "decode-0 restarted (pid 101, restart 1)" in caplog.text
    st = sup.status()["decode-0"]
    assert st == {"state": "running", "pid": 101, "restarts": 1, "last_exit": "signal SIGKILL",
                  "pids": [100, 101]}
    assert changes[-1] == {"decode-0": 1, "prefill-0": 0}

    a.exit = 1  # crashes again quickly: the backoff doubled
    clock.now += 1
    sup.step()
    clock.now += 0.99
    sup.step()
    assert a.starts == 1
    clock.now += 0.01
    sup.step()
    assert a.starts == 2 and sup.restarts()["decode-0"] == 2


def test_supervisor_raises_a_clear_crash_loop_error() -> None:
    clock = FakeClock()
    sup = Supervisor(RestartPolicy(max_restarts=2, window_s=60, initial_backoff_s=0.5,
                                   max_backoff_s=2), clock=clock)
    c = ScriptedChild("conductor")
    sup.add(c)
    for _ in range(2):
        c.exit = 1
        sup.step()
        clock.now += 5
        sup.step()
    assert c.starts == 2
    c.exit = 1
    with pytest.raises(CrashLoopError) as e:
        sup.step()
    msg = str(e.value)
    assert e.value.child == "conductor" and e.value.status == "exit code 1"
    assert "conductor is crash-looping: it exited 3 times within 60s (last: exit code 1)" in msg
    assert "Address already in use" in msg
