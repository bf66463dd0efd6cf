"""`mooncake calibrate --links-only`: the links between hosts measured through a real store.

A master, a storage node on this host (reads are shared-memory copies) and one in this process
that says it is on another host (reads cross TCP on loopback). Loopback moves bytes at about
memcpy speed, so what is asserted is the shape of the result, not a rate: both links fitted
from every sample with sane coefficients, the profile written with them and loading back, the
base profile's other numbers untouched, and nothing left behind in the store.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from mooncake_k8s.cli.main import main
from mooncake_k8s.conductor.sched.costmodel import BUILTIN_CPU_PROFILE, load
from mooncake_k8s.conductor.tools import links
from mooncake_k8s.store.node.server import NodeConfig, StorageNode
from mooncake_k8s.store.testing import store_cluster

SIZES = "64KiB,256KiB,1MiB,2MiB"
REPEATS = 2


def test_links_only_fits_this_host_and_another_into_the_profile(tmp_path: Path) -> None:
    out = tmp_path / "bed.json"
    with store_cluster(nodes=0) as cluster:
        cluster.start_node("n0", "16MiB")  # this host
        far = StorageNode(NodeConfig(master=cluster.master_address, node_id="far",
                                     token=cluster.token, dram_size=16 << 20,
                                     host_id="host-far"))
        far.start()
        try:
            assert far.wait_registered(30)
            r = CliRunner().invoke(main, [
                "calibrate", "--links-only", "--master", cluster.master_address,
                "--token", cluster.token, "--profile", BUILTIN_CPU_PROFILE, "--name", "bed",
                "--link-sizes", SIZES, "--link-repeats", str(REPEATS), "--out", str(out)])
            assert r.exit_code == 0, r.output
            with cluster.client() as c:
                assert c.stats().objects == 0  # every probe object removed
        finally:
            far.stop()
    model = load(out)
    base = load(BUILTIN_CPU_PROFILE)
    assert model.name == "bed"
    assert (model.prefill, model.decode, model.kv_bytes_per_token) == (
        base.prefill, base.decode, base.kv_bytes_per_token)
    measured = model.extra["links"]
    for path, fit in (("pool", measured["pool_fit"]), ("local", measured["local_fit"])):
        link = model.transfer[path]
        assert fit["samples"] == 4 * REPEATS
        assert math.isclose(link.gbps, fit["gbps"], rel_tol=1e-3, abs_tol=1e-4)
        assert math.isclose(link.latency_ms, fit["latency_ms"], abs_tol=1e-4)
        assert 0 < link.gbps <= links.FREE_GBPS and 0 <= link.latency_ms < 1000
        assert -1.0 <= fit["r2"] <= 1.0
    segs = measured["segments"]
    assert segs["far-dram-0"]["host_id"] == "host-far" and not segs["far-dram-0"]["same_host"]
    assert segs["n0-dram-0"]["same_host"]
    assert len(measured["samples_segment_bytes_get_put_ms"]) == 2 * 4 * REPEATS
    assert json.loads(out.read_text())["transfer"]["pool"]["gbps"] == model.transfer["pool"].gbps


def test_links_only_without_a_master_or_with_one_size_is_refused() -> None:
    r = CliRunner().invoke(main, ["calibrate", "--links-only", "--out", "x.json"],
                           env={"MOONCAKE_MASTER": ""})
    assert r.exit_code == 2 and "--master" in r.output
    r = CliRunner().invoke(main, ["calibrate", "--links-only", "--master", "127.0.0.1:1",
                                  "--link-sizes", "1MiB", "--out", "x.json"])
    assert r.exit_code == 2 and "two different sizes" in r.output


def test_a_named_segment_that_does_not_exist_is_named_in_the_error() -> None:
    with store_cluster(nodes=1, dram_size="8MiB") as cluster, \
            pytest.raises(links.LinkError, match=r"nope.*n0-dram-0"):
        links.measure(links.LinkConfig(cluster.master_address, cluster.token,
                                       segments=("nope",)), lambda _: None)
