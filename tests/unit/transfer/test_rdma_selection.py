"""RDMA selection rules: `auto` never picks RDMA, an explicit `rdma` fails naming the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.transfer.engine import Peer, TransferEngine
from mooncake_k8s.transfer.rdma import detect_rdma


def test_explicit_rdma_refused_with_reason() -> None:
    status = detect_rdma()
    with pytest.raises(InvalidArgument, match="transport 'rdma' asked for") as e:
        TransferEngine(transport="rdma")
    if not status.available:
        assert status.reason in str(e.value)
    else:
        assert "not implemented" in str(e.value)


def test_auto_never_selects_rdma() -> None:
    eng = TransferEngine(transport="auto", host_id="here")
    try:
        assert eng.transport_name(Peer("n1", "127.0.0.1:1", "elsewhere")) == "tcp"
        assert eng.transport_name(Peer("n2", "127.0.0.1:2", "here")) == "shm"
    finally:
        eng.close()


def test_missing_sysfs_reason(tmp_path: Path) -> None:
    status = detect_rdma(str(tmp_path / "absent"))
    assert not status.available and "does not exist" in status.reason
