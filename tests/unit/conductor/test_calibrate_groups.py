"""`mooncake calibrate` and prefill groups: the group entry it writes, and how it finds groups.

The fit is checked on samples made from a known group model over calibrate's own prompt
pattern (cold prompts of its default lengths, each then extended by its suffix), so the entry
it writes must give that model back, and survive the profile file. Finding the groups goes
through the real Conductor front end over HTTP on loopback (`GET /v1/instances`, the pin header
refused when malformed), with real instance records behind it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer

from mooncake_k8s.common.rpc import serving_pb2 as pb
from mooncake_k8s.conductor.http.api import Frontend, make_app
from mooncake_k8s.conductor.metrics import ConductorMetrics
from mooncake_k8s.conductor.sched import costmodel
from mooncake_k8s.conductor.sched.costmodel import (
    BUILTIN_CPU_PROFILE,
    CostModelError,
    GroupPrefill,
    load,
    pipelined,
)
from mooncake_k8s.conductor.sched.kvindex import KVIndex
from mooncake_k8s.conductor.sched.scheduler import Scheduler, SchedulerConfig
from mooncake_k8s.conductor.serving.instances import Instance, InstancePool
from mooncake_k8s.conductor.serving.pipeline import Pipeline
from mooncake_k8s.conductor.serving.router import MooncakeRouter
from mooncake_k8s.conductor.tools import calibrate as cal

CFG = cal.CalibrateConfig(url="http://unused")


def _samples(model: GroupPrefill) -> cal.Samples:
    """What calibrate would measure of `model`, exactly: cold, then the prompt + suffix."""
    out: cal.Samples = []
    for _ in range(CFG.repeats):
        for n in CFG.lengths:
            out.append((n, 0, model.ms(n)))
            out.append((CFG.suffix_tokens, n, model.ms(CFG.suffix_tokens, n)))
    return out


def test_the_group_entry_is_fitted_written_and_read_back(tmp_path: Path) -> None:
    base = load(BUILTIN_CPU_PROFILE)
    # Fixed 256-token chunks (--pipeline-chunks 0): every term identifiable from calibrate's
    # lengths. (With the workers' default, a prompt cut into 8 chunks, the first chunk of a
    # long prompt is ~n / 8 and the fill's columns nearly repeat the per-token and attention
    # ones: the fit is then exact only within the calibrated lengths.)
    truth = pipelined(base.prefill, 2, 256, 0)
    assert isinstance(truth, GroupPrefill)
    model = cal.with_groups(base, {2: _samples(truth)}, chunk_tokens=256, chunks=0)
    fit = model.prefill_groups[2]
    for n, c in ((64, 0), (256, 0), (1000, 0), (3000, 0), (7000, 0), (64, 2048)):
        assert fit.ms(n, c) == pytest.approx(truth.ms(n, c), rel=1e-6), (n, c)
    assert model.extra["prefill_group_fits"]["2"]["samples"] == len(_samples(truth))
    assert "prefill_note" not in model.extra  # a single instance was measured too
    path = tmp_path / "cal.json"
    model.save(path)
    raw = json.loads(path.read_text())
    assert set(raw["prefill_groups"]) == {"2"}
    again = load(path)
    assert again.to_dict() == model.to_dict()
    assert again.prefill_for(2) == fit and again.measured_group(2)
    assert not again.measured_group(3)  # estimated from the single fit
    assert again.prefill_for(3) == pipelined(base.prefill, 3)
    # With no single instance served, the profile says whose fit `prefill` is.
    only = cal.with_groups(base, {2: _samples(truth)}, single=False, chunk_tokens=256, chunks=0)
    assert "group of 2" in only.extra["prefill_note"]


def test_profiles_without_groups_load_as_before_and_bad_entries_are_refused() -> None:
    for name in costmodel.profiles():
        m = load(name)
        assert m.prefill_groups == {} and "prefill_groups" not in m.to_dict()
        assert m.prefill_ms(1000, 0, group=1) == m.prefill_ms(1000)
    d = load(BUILTIN_CPU_PROFILE).to_dict()
    good = {"base_ms": 1.0, "per_token_ms": 0.5, "attn_ms": 0.0}
    for groups, message in (({"1": good}, "integer >= 2"), ({"two": good}, "integer >= 2"),
                            ({"2": {**good, "per_token_ms": -1}}, "prefill_groups.2"),
                            ({"2": {**good, "warp": 1}}, "malformed")):
        with pytest.raises(CostModelError, match=message):
            costmodel.CostModel.from_dict({**d, "prefill_groups": groups})
    # A plain linear entry (no fill terms) is a valid group entry too.
    m = costmodel.CostModel.from_dict({**d, "prefill_groups": {"2": good}})
    assert m.prefill_ms(100, 0, group=2) == pytest.approx(1.0 + 50.0)
    assert dataclasses.replace(m, name="x").prefill_groups == m.prefill_groups


def _inst(name: str, stage: int = -1, whole: bool = True) -> Instance:
    group = {} if stage < 0 else {"pipeline_group": "g0", "pipeline_stage": stage,
                                  "pipeline_group_size": 2, "pipeline_whole": whole}
    rep = pb.LoadReport(instance_id=name, role="prefill", revision="v1", ready=True,
                        **group)  # type: ignore[arg-type]
    return Instance(f"{name}:1", "prefill", grpc.aio.insecure_channel("127.0.0.1:1"), rep,
                    True)


def test_calibrate_finds_the_kinds_of_target_the_conductor_lists() -> None:
    async def main() -> None:
        prefills = InstancePool("prefill", "", "")
        for i in (_inst("p0"), _inst("g0-0", 0), _inst("g0-1", 1)):
            prefills.instances[i.address] = i
        prefills.groups()
        router = MooncakeRouter(Scheduler(SchedulerConfig(), load(BUILTIN_CPU_PROFILE),
                                          KVIndex()))
        pipe = Pipeline(prefills, InstancePool("decode", "", ""), router)
        front = Frontend(pipe, ConductorMetrics(), {"k": "t"}, "m")
        server = TestServer(make_app(front))
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        auth = {"Authorization": "Bearer k"}
        try:
            async with aiohttp.ClientSession() as session:
                c = cal._Client(dataclasses.replace(CFG, url=url, api_key="k"), session)
                assert await c.target_sizes() == {1, 2}
                async with session.get(f"{url}/v1/instances", headers=auth) as r:
                    listing = await r.json()
                states = {i["instance_id"]: i["state"] for i in listing["prefill"]}
                assert states == {"p0": "ready", "g0-0": "ready", "g0-1": "stage"}
                stage = next(i for i in listing["prefill"] if i["instance_id"] == "g0-1")
                assert stage["group"] == {"name": "g0", "stage": 1, "size": 2, "whole": True,
                                          "broken": ""}
                assert "127.0.0.1" not in json.dumps(listing)  # ids, not addresses
                # The group loses a stage: calibrate sees only single instances to measure.
                prefills.mark_failed(prefills.instances["g0-1:1"], "UNAVAILABLE")
                prefills.groups()
                assert await c.target_sizes() == {1}
                async with session.get(f"{url}/v1/instances") as r:
                    assert r.status == 401  # the API key applies
                for bad in ("0", "two", "65"):
                    async with session.post(f"{url}/v1/completions",
                                            headers={**auth, cal.GROUP_HEADER: bad},
                                            json={"model": "m", "prompt": [1]}) as r:
                        body = await r.json()
                        assert r.status == 400, bad
                        assert body["error"]["param"] == cal.GROUP_HEADER
        finally:
            await server.close()

    asyncio.run(main())
