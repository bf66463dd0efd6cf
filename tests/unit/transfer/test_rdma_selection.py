"""RDMA selection rules: nothing but an explicit `rdma` selects it, and an explicit `rdma`
where no device and pyverbs exist fails at construction naming the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.transfer.engine import TRANSPORTS, Peer, TransferEngine
from mooncake_k8s.transfer.rdma import detect_rdma


def test_explicit_rdma_refused_with_reason() -> None:
    status = detect_rdma()
    if status.available:
        pytest.skip(f"this machine has RDMA ({status.reason})")
    with pytest.raises(InvalidArgument, match="transport 'rdma' asked for but unavailable") as e:
        TransferEngine(transport="rdma")
    assert status.reason in str(e.value)


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "rdma"])
def test_only_an_explicit_rdma_selects_it(transport: str) -> None:
    eng = TransferEngine(transport=transport, host_id="here")
    try:
        remote = Peer("n1", "127.0.0.1:1", "elsewhere")
        local = Peer("n2", "127.0.0.1:2", "here")
        names = {eng.transport_name(remote), eng.transport_name(local)}
        assert "rdma" not in names
        assert eng.rdma_state() in ("unavailable", "untested")  # never "active"
        if transport == "auto":
            assert (eng.transport_name(remote), eng.transport_name(local)) == ("tcp", "shm")
    finally:
        eng.close()


def test_missing_sysfs_reason(tmp_path: Path) -> None:
    status = detect_rdma(str(tmp_path / "absent"))
    assert not status.available and "does not exist" in status.reason


def test_empty_sysfs_reason(tmp_path: Path) -> None:
    status = detect_rdma(str(tmp_path))
    assert not status.available and "no RDMA devices in" in status.reason


def test_device_present_needs_pyverbs_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device in sysfs is not enough: without importable pyverbs the reason says so."""
    (tmp_path / "mlx5_0").mkdir()
    with_pyverbs = detect_rdma(str(tmp_path))
    assert with_pyverbs.devices == ("mlx5_0",)
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        assert not with_pyverbs.available
    else:
        assert with_pyverbs.available and "mlx5_0" in with_pyverbs.reason
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "pyverbs" not in p])
    monkeypatch.delitem(sys.modules, "pyverbs", raising=False)
    status = detect_rdma(str(tmp_path))
    assert not status.available and "pyverbs not importable" in status.reason
    assert status.devices == ("mlx5_0",)
