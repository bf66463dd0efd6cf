"""The transfer engine's I/O timeout is bounded by default: a partitioned peer (nothing
answers, nothing resets) fails a transfer in seconds, never after TCP's minutes."""

from __future__ import annotations

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.transfer import TransferEngine
from mooncake_k8s.transfer.engine import DEFAULT_IO_TIMEOUT_S


def test_default_io_timeout_is_short_and_never_above_the_call_timeout() -> None:
    with TransferEngine("t", transport="tcp") as eng:
        assert eng.io_timeout_s == DEFAULT_IO_TIMEOUT_S <= 5.0
    with TransferEngine("t", transport="tcp", timeout_s=2.0) as eng:
        assert eng.io_timeout_s == 2.0
    with TransferEngine("t", transport="tcp", timeout_s=60.0, io_timeout_s=0.5) as eng:
        assert eng.io_timeout_s == 0.5


def test_a_non_positive_timeout_is_refused_naming_it() -> None:
    """At construction (0 used to mean "the call timeout" without a word)."""
    with pytest.raises(InvalidArgument, match=r"io_timeout_s=0\.0"):
        TransferEngine("t", transport="tcp", io_timeout_s=0.0)
    with pytest.raises(InvalidArgument, match="timeout_s=-1"):
        TransferEngine("t", transport="tcp", timeout_s=-1)
