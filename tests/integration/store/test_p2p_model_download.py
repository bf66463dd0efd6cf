"""The operator's model download with model.huggingFace.p2p, run for real (issue 22 item 2).

The init container's command is taken from the rendered StatefulSet and run as a process
against a real store master and storage nodes. The Hugging Face Hub is the one part that is
not ours and not reachable here: a stand-in `huggingface_hub` package on PYTHONPATH copies the
model from a local directory and counts its downloads. The first pod downloads from the "Hub"
and publishes; the second fetches from its peers without touching the Hub; a restarted pod
finds its marker and does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_k8s.operator import naming
from mooncake_k8s.operator.render import render
from mooncake_k8s.operator.validation import validate_cluster
from mooncake_k8s.store.node.server import StorageNode
from mooncake_k8s.store.testing import StoreCluster, start_host_node

MiB = 1 << 20
_HUB = '''\
import os, shutil
from pathlib import Path

def snapshot_download(repo_id, revision, local_dir):
    with open(os.environ["HUB_COUNT"], "a") as f:
        f.write(repo_id + "@" + revision + "\\n")
    shutil.copytree(Path(os.environ["HUB_DIR"]) / repo_id, local_dir, dirs_exist_ok=True)
    return local_dir
'''


@pytest.fixture
def store() -> Iterator[StoreCluster]:
    with StoreCluster() as cluster:
        cluster.start_master()
        nodes: list[StorageNode] = []
        try:
            nodes += [start_host_node(cluster, n, h, 16 * MiB)
                      for n, h in (("na", "hA"), ("nb", "hB"))]
            cluster.wait_nodes(2)
            yield cluster
        finally:
            for node in nodes:
                node.stop()


def rendered_command() -> list[str]:
    doc = {"apiVersion": "mooncake.io/v1alpha1", "kind": "MooncakeCluster",
           "metadata": {"name": "demo", "namespace": "ml",
                        "uid": "00000000-0000-4000-8000-000000000001"},
           "spec": {"model": {"huggingFace": {"id": "org/tiny", "p2p": True}}}}
    sts = render(validate_cluster(doc)).get("StatefulSet", naming.name("demo", "decode"))
    init = next(c for c in sts["spec"]["template"]["spec"]["initContainers"]
                if c["name"] == "model-download")
    command: list[str] = init["command"]
    return command


def test_first_pod_downloads_and_publishes_later_pods_fetch_from_peers(
        store: StoreCluster, tmp_path: Path) -> None:
    hub = tmp_path / "hub" / "org" / "tiny"
    (hub / "sub").mkdir(parents=True)
    (hub / "model.safetensors").write_bytes(os.urandom(3 * MiB + 17))
    (hub / "config.json").write_text('{"layers": 1}')
    (hub / "sub" / "tokenizer.json").write_text('{"vocab": {}}')
    stub = tmp_path / "stub" / "huggingface_hub"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(_HUB)
    count = tmp_path / "hub-downloads"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub"), "HUB_DIR": str(tmp_path / "hub"),
           "HUB_COUNT": str(count), "MOONCAKE_MASTER": store.master_address,
           "MOONCAKE_CLUSTER_TOKEN": store.token}
    command = rendered_command()
    assert command[3:5] == ["org/tiny", "main"]

    def pod(dest: Path) -> None:
        argv = [sys.executable, *command[1:5], str(dest), *command[6:]]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr

    pod(tmp_path / "pod1")
    assert count.read_text() == "org/tiny@main\n"  # nobody had it: from the Hub
    pod(tmp_path / "pod2")
    assert count.read_text() == "org/tiny@main\n"  # from its peers
    for rel in ("model.safetensors", "config.json", "sub/tokenizer.json"):
        assert (tmp_path / "pod2" / rel).read_bytes() == (hub / rel).read_bytes(), rel
    assert (tmp_path / "pod2" / ".mooncake-complete").read_text() == "main\n"
    assert not list((tmp_path / "pod2").rglob("*.p2p-part"))
    pod(tmp_path / "pod2")  # a restarted container: the marker says done
    assert count.read_text() == "org/tiny@main\n"
