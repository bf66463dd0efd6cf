"""The drain policy's arithmetic (`worker.base`): which streams a draining decode lets finish
and which it hands over, and the margin kept at the grace's end."""

from __future__ import annotations

import pytest

from mooncake_k8s.engine.api import StreamState
from mooncake_k8s.worker.base import HANDOFF_SAFETY, drain_margin, hand_off_now


def test_a_stream_that_fits_in_the_grace_left_finishes() -> None:
    s = StreamState("r", remaining=10, running=True)
    assert not hand_off_now(s, step_s=0.02, left_s=10 * 0.02 * HANDOFF_SAFETY + 0.01)
    assert hand_off_now(s, step_s=0.02, left_s=10 * 0.02 * HANDOFF_SAFETY - 0.01)


def test_no_grace_left_or_not_in_the_batch_hands_over_at_once() -> None:
    assert hand_off_now(StreamState("r", 1, True), step_s=0.001, left_s=0.0)
    assert hand_off_now(StreamState("r", 1, False), step_s=0.001, left_s=60.0)
    # Before the first step is timed the estimate is 0: a running stream may finish.
    assert not hand_off_now(StreamState("r", 500, True), step_s=0.0, left_s=1.0)


@pytest.mark.parametrize(("grace", "margin"), [(30.0, 3.0), (5.0, 0.5), (2.0, 0.5),
                                                (0.6, 0.3), (0.0, 0.0)])
def test_the_margin_is_a_tenth_at_least_half_a_second_at_most_half(grace: float,
                                                                   margin: float) -> None:
    assert drain_margin(grace) == pytest.approx(margin)
