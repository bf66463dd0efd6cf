"""The P2P store's manifest: chunking, digests, verification of a stored manifest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mooncake_k8s.common.errors import InvalidArgument
from mooncake_k8s.store.p2p.manifest import VERSION, build, check_name, chunk_digest, decode


def tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 10)  # 2560 bytes
    (root / "sub" / "b.txt").write_bytes(b"hello")
    (root / "empty").write_bytes(b"")
    (root / "sub" / "b.txt").chmod(0o640)
    return root


def test_files_are_cut_into_chunks_that_tile_each_file(tmp_path: Path) -> None:
    man = build(tree(tmp_path / "d"), "org/model", chunk_size=1000)
    assert [(f.path, f.size, f.count) for f in man.files] == [
        ("a.bin", 2560, 3), ("empty", 0, 0), ("sub/b.txt", 5, 1)]
    assert [c.size for c in man.chunks] == [1000, 1000, 560, 5]
    assert man.files[2].mode == 0o640 and man.total_bytes == 2565
    data = (tmp_path / "d" / "a.bin").read_bytes()
    assert [c.digest for c in man.chunks[:3]] == [
        chunk_digest(data[0:1000]), chunk_digest(data[1000:2000]), chunk_digest(data[2000:])]


def test_manifest_round_trips_and_its_digest_names_its_content(tmp_path: Path) -> None:
    root = tree(tmp_path / "d")
    man = build(root, "m", chunk_size=1000)
    assert decode(man.encode()) == man
    assert build(root, "m", chunk_size=1000).digest == man.digest
    (root / "sub" / "b.txt").write_bytes(b"hellO")
    assert build(root, "m", chunk_size=1000).digest != man.digest


def test_an_altered_manifest_is_refused(tmp_path: Path) -> None:
    man = build(tree(tmp_path / "d"), "m", chunk_size=1000)
    env = json.loads(man.encode())
    env["manifest"]["chunks"][0][1] = "0" * 32
    with pytest.raises(InvalidArgument, match="digest mismatch"):
        decode(json.dumps(env).encode())
    env = json.loads(man.encode())
    env["manifest"]["version"] = VERSION + 1
    with pytest.raises(InvalidArgument, match="version"):
        decode(json.dumps(env).encode())
    with pytest.raises(InvalidArgument, match="malformed"):
        decode(b"{not json")


def test_a_manifest_whose_path_leaves_the_directory_is_refused(tmp_path: Path) -> None:
    man = build(tree(tmp_path / "d"), "m", chunk_size=1000)
    env = json.loads(man.encode())
    env["manifest"]["files"][1][0] = "../evil"
    # re-digest, so that only the layout check can refuse it
    env["digest"] = hashlib.blake2b(json.dumps(env["manifest"], sort_keys=True,
                                               separators=(",", ":")).encode(),
                                    digest_size=32).hexdigest()
    with pytest.raises(InvalidArgument, match="leaves the directory"):
        decode(json.dumps(env).encode())


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", "x" * 201, "sp ace", "a#b"])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="p2p name"):
        check_name(bad)
    assert check_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


def test_symlinks_and_missing_directories_are_refused(tmp_path: Path) -> None:
    root = tree(tmp_path / "d")
    (root / "link").symlink_to(root / "a.bin")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        build(root, "m")
    with pytest.raises(InvalidArgument, match="not a directory"):
        build(tmp_path / "nope", "m")
