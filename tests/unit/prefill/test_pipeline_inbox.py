"""A stage's inbox over the real transfer engine and server: hidden states written by the
upstream arrive bit-exact and checksum-verified; a wrong announcement, a torn slot or a
missing credit fails the prompt with a cause, never wrong data or a hang."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.prefill.pipeline.inbox import (
    Inbox,
    InboxTarget,
    SlotRing,
    StageFailed,
    tensor_bytes,
)
from mooncake_k8s.prefill.pipeline.leader import chunk_bounds
from mooncake_k8s.transfer.engine import TransferEngine

TOKEN = "inbox-token"


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    box = Inbox(f"pipe-test-{uuid.uuid4().hex[:8]}", 2, 4 * 8 * 2, host="127.0.0.1",
                advertise_host=None, token=TOKEN, host_id="inbox-test-host")
    yield box
    box.close()


def _target(box: Inbox) -> InboxTarget:
    reply = pb.StageHelloReply(stage=1, instance_id="s1")
    box.describe(reply)
    return InboxTarget.from_reply(reply)


@pytest.mark.parametrize("transport", ["tcp", "auto"])
def test_hidden_states_arrive_bit_exact(inbox: Inbox, transport: str) -> None:
    h = torch.randn(4, 8).to(torch.bfloat16)
    with TransferEngine(TOKEN, transport=transport) as eng:
        data = tensor_bytes(h)
        sum_ = _target(inbox).write(eng, 1, data)
    got = inbox.take(pb.StageChunk(slot=1, start=64, end=68, nbytes=len(data), checksum=sum_),
                     torch.bfloat16)
    assert torch.equal(got, h)


def test_a_wrong_checksum_or_announcement_fails(inbox: Inbox) -> None:
    with pytest.raises(StageFailed, match="checksum") as e:
        inbox.take(pb.StageChunk(slot=0, start=0, end=1, nbytes=16, checksum=1), torch.float32)
    assert e.value.cause == "checksum"
    with pytest.raises(StageFailed, match="bad chunk announcement"):
        inbox.take(pb.StageChunk(slot=5, start=0, end=1, nbytes=16), torch.float32)


def test_a_wrong_token_cannot_write(inbox: Inbox) -> None:
    with TransferEngine("not-the-token", transport="tcp") as eng, \
            pytest.raises(StageFailed) as e:
        _target(inbox).write(eng, 0, memoryview(b"x" * 16))
    assert e.value.cause == "transfer"


def test_the_ring_bounds_a_silent_receiver() -> None:
    ring = SlotRing(1)
    assert ring.take(1.0) == 0
    with pytest.raises(StageFailed, match="freed no inbox slot") as e:
        ring.take(0.05)
    assert e.value.cause == "timeout"
    ring.give(0)
    assert ring.take(0.05) == 0
    ring.fail(RuntimeError("stream reset"))
    with pytest.raises(StageFailed, match="stream reset"):
        ring.take(1.0)


def test_chunks_are_cut_at_absolute_boundaries() -> None:
    assert chunk_bounds(128, 700, 256) == [(128, 256), (256, 512), (512, 700)]
    assert chunk_bounds(0, 10, 256) == [(0, 10)]
    assert chunk_bounds(512, 512, 256) == []
