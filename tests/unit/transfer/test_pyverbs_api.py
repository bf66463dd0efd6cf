"""pyverbs, as the RDMA transport uses it: importable in our venv (scripts/setup.sh exposes
Debian's python3-pyverbs), and every name, constructor argument and attribute the transport
relies on still exists, so a pyverbs API change fails here and not first on an RDMA cluster.
Nothing here needs a device; no machine running this suite has one."""

from __future__ import annotations

import importlib
import sysconfig
from pathlib import Path

import pytest

SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")


def _setup_can_provide_pyverbs() -> bool:
    """What scripts/setup.sh checks before exposing the system's pyverbs to the venv."""
    return (SYSTEM_PYVERBS / f"device{sysconfig.get_config_var('EXT_SUFFIX')}").is_file()


if not _setup_can_provide_pyverbs():  # e.g. a distribution whose pyverbs targets another Python
    pytest.skip("no python3-pyverbs built for this interpreter", allow_module_level=True)

# From here on pyverbs must import: setup.sh makes it so wherever the check above holds.
import pyverbs.cq as pv_cq  # noqa: E402
import pyverbs.device as pv_device  # noqa: E402
import pyverbs.enums as pv_enums  # noqa: E402
import pyverbs.mr as pv_mr  # noqa: E402
import pyverbs.qp as pv_qp  # noqa: E402

from mooncake_k8s.common.errors import TransferError  # noqa: E402
from mooncake_k8s.transfer import frames as fr  # noqa: E402
from mooncake_k8s.transfer import rdma_verbs  # noqa: E402
from mooncake_k8s.transfer.rdma import detect_rdma  # noqa: E402
from mooncake_k8s.transfer.rdma_plan import PathParams  # noqa: E402

GID = bytes.fromhex("fe800000000000000202c9fffe000001")


def test_pyverbs_imports_from_the_venv() -> None:
    mod = importlib.import_module("pyverbs")
    assert mod.__file__ is not None
    # Exposed alone: the rest of the system's dist-packages stays invisible to the venv.
    with pytest.raises(ImportError):
        importlib.import_module("apt_pkg")


def test_every_pyverbs_name_the_transport_uses_exists() -> None:
    missing = [f"{mod.__name__}.{name}" for mod, name in rdma_verbs.PYVERBS_NAMES
               if not hasattr(mod, name)]
    assert missing == []
    enums = [name for mod, name in rdma_verbs.PYVERBS_NAMES if mod is pv_enums]
    assert all(isinstance(getattr(pv_enums, n), int) for n in enums)
    # Methods and attributes the transport calls on objects it can only get from a device.
    for cls, attrs in [
        (pv_qp.QP, ("to_init", "to_rtr", "to_rts", "post_send", "qp_num", "close")),
        (pv_cq.CQ, ("poll", "close")),
        (pv_cq.WC, ("status", "vendor_err", "wr_id")),
        (pv_mr.MR, ("buf", "lkey", "rkey", "close")),
        (pv_device.Context, ("query_port", "query_device", "query_gid",
                                        "query_gid_type", "close")),
        (pv_device.PortAttr, ("state", "link_layer", "lid", "active_mtu",
                                         "max_msg_sz", "gid_tbl_len")),
        (pv_device.DeviceAttr, ("max_qp_rd_atom", "max_qp_init_rd_atom",
                                           "max_qp_wr")),
    ]:
        assert [a for a in attrs if not hasattr(cls, a)] == [], cls


def test_mtu_codes_match_the_wire_range() -> None:
    """frames accepts mtu codes 1..5: the verbs enum's 256 B .. 4 KiB."""
    assert (pv_enums.IBV_MTU_256, pv_enums.IBV_MTU_4096) == (1, 5)


def test_work_request_built_as_posted() -> None:
    wr = rdma_verbs.build_send_wr(pv_enums.IBV_WR_RDMA_READ, 5, 0x1000, 64, 3, 0x2000, 9)
    assert (wr.wr_id, wr.opcode, wr.num_sge) == (5, pv_enums.IBV_WR_RDMA_READ, 1)
    assert wr.send_flags == pv_enums.IBV_SEND_SIGNALED


def test_queue_pair_creation_attributes() -> None:
    init = rdma_verbs.build_qp_init_attr(None, 64)  # the CQ needs a device; None builds too
    assert init.qp_type == pv_enums.IBV_QPT_RC and init.sq_sig_all == 0
    assert (init.max_send_wr, init.max_send_sge, init.max_recv_wr) == (64, 1, 1)


@pytest.mark.parametrize("is_global", [True, False])
def test_qp_attributes_carry_the_peer_and_the_negotiated_path(is_global: bool) -> None:
    peer = fr.RdmaEndpoint(0x123, 0x456, 7, GID, 5, 16, 1 << 30)
    attr = rdma_verbs.build_qp_attr(0x789, peer, PathParams(3, 1 << 30, 4), port=1,
                                    gid_index=3, is_global=is_global)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (0x123, 0x456, 0x789)
    assert (attr.path_mtu, attr.max_rd_atomic, attr.max_dest_rd_atomic) == (3, 4, 4)
    assert attr.qp_access_flags == rdma_verbs.REMOTE_ACCESS
    assert attr.qp_access_flags & pv_enums.IBV_ACCESS_REMOTE_WRITE
    assert attr.qp_access_flags & pv_enums.IBV_ACCESS_REMOTE_READ
    ah = attr.ah_attr
    assert (ah.dlid, ah.port_num, ah.is_global) == (7, 1, int(is_global))
    if is_global:
        assert (ah.dgid, ah.sgid_index) == ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 3)


def test_opening_a_device_where_none_exists_says_so() -> None:
    if detect_rdma().available:
        pytest.skip("this machine has an RDMA device")
    with pytest.raises(TransferError, match="no RDMA devices"):
        rdma_verbs.VerbsDevice()
