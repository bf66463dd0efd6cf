"""Store master failover: takeover time and data safety, and what HA costs a put.

Scenarios, each with real processes on loopback (two storage nodes, two writers and a reader
putting and reading 16 KiB objects):

- `ha-kill9`: two masters on a real redis-server (`--metadata-backend redis`, default 2 s
  lease); the leader is killed with SIGKILL mid-load. Takeover = kill to the first put
  acknowledged afterwards.
- `ha-sigstop`: the leader is frozen (SIGSTOP) instead; once a standby took over it is resumed
  and must refuse writes and exit (status 3).
- `embedded-restart`: the alternative without HA: one master (with its state dir) killed and
  started again at once, as a supervisor would.

After each trial every acknowledged object is read back: `lost` (acknowledged, now missing) and
`wrong` (bytes differ) must be 0. Then the price of HA: the latency of a 64 KiB put at queue
depth 1 with one master (embedded) and with the Redis leader, which journals each commit before
acknowledging it.

Mooncake's own HA (etcd leader election) is not measured: it needs an etcd cluster, which this
machine cannot run; the embedded restart is the baseline instead.

    python bench/ha_bench.py [--trials 3] [--json bench/results/ha_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mooncake_k8s.store.testing import HaStoreCluster, PutGetLoad, StoreCluster

KiB = 1 << 10


def _trial(cluster: StoreCluster, fault: Any) -> dict[str, Any]:
    load = PutGetLoad(cluster)
    load.start()
    load.acks_after(time.monotonic(), 100)
    extra = fault()  # returns once the leader is dead or frozen
    t0 = time.monotonic()
    takeover = load.acks_after(t0, 20, timeout=60)
    time.sleep(0.5)
    load.finish()
    lost, wrong = load.verify_all()
    return {"takeover_s": round(takeover, 3), "acked": len(load.acked), "lost": lost,
            "wrong": wrong + load.wrong, "failed_puts": load.failed_puts, **extra}


def ha_trials(n: int, sigstop: bool) -> list[dict[str, Any]]:
    out = []
    with HaStoreCluster(lease_ms=2000) as cluster:
        cluster.start_masters()
        cluster.start_node("a", "256MiB")
        cluster.start_node("b", "256MiB")
        for _ in range(n):
            name, leader = cluster.leader()

            def fault(name: str = name, leader: Any = leader) -> dict[str, Any]:
                if sigstop:
                    cluster.pause(leader)
                else:
                    cluster.kill(leader)
                return {"old_leader": name}

            r = _trial(cluster, fault)
            if sigstop:
                cluster.resume(leader)
                r["deposed_exit"] = leader.popen.wait(timeout=30)
            elif leader.alive():
                r["deposed_exit"] = None
            r["new_leader"] = cluster.leader()[0]
            cluster.start_ha_master(r["old_leader"])  # back as a standby for the next trial
            out.append(r)
    return out


def embedded_trials(n: int) -> list[dict[str, Any]]:
    out = []
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "256MiB")
        cluster.start_node("b", "256MiB")
        for _ in range(n):
            out.append(_trial(cluster, lambda: (cluster.restart_master(wait=False), {})[1]))
    return out


def put_latency(cluster: StoreCluster, n: int = 400) -> dict[str, float]:
    data = bytes(64 * KiB)
    lat = []
    with cluster.client(transport="tcp") as c:
        for i in range(n + 50):
            t = time.perf_counter()
            c.put(f"lat-{i}", data)
            if i >= 50:
                lat.append(time.perf_counter() - t)
    lat.sort()
    return {"p50_ms": round(statistics.median(lat) * 1e3, 3),
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3)}


def latency_rows() -> dict[str, dict[str, float]]:
    rows = {}
    with StoreCluster() as cluster:
        cluster.start_master()
        cluster.start_node("a", "256MiB")
        rows["embedded"] = put_latency(cluster)
    with HaStoreCluster(lease_ms=2000) as ha:
        ha.start_masters()
        ha.start_node("a", "256MiB")
        rows["redis-ha"] = put_latency(ha)
    return rows


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    t = [r["takeover_s"] for r in trials]
    return {"trials": len(trials), "takeover_p50_s": round(statistics.median(t), 3),
            "takeover_max_s": max(t), "acked": sum(r["acked"] for r in trials),
            "lost": sum(r["lost"] for r in trials), "wrong": sum(r["wrong"] for r in trials)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} cpus={len(os.sched_getaffinity(0))}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "scenarios": {},
    }
    runs: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        ("ha-kill9", lambda: ha_trials(a.trials, False)),
        ("ha-sigstop", lambda: ha_trials(a.trials, True)),
        ("embedded-restart", lambda: embedded_trials(a.trials))]
    for name, run in runs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        trials = run()
        results["scenarios"][name] = {"summary": summary(trials), "trials": trials}
    print("running put latency ...", file=sys.stderr, flush=True)
    results["put_64k_qd1"] = latency_rows()

    print(f"\nMaster failover ({results['date']}, {results['machine']})")
    print(f"{'scenario':<18}{'trials':>7}{'takeover p50':>14}{'max':>8}{'acked':>8}"
          f"{'lost':>6}{'wrong':>7}")
    for name, s in results["scenarios"].items():
        m = s["summary"]
        print(f"{name:<18}{m['trials']:>7}{m['takeover_p50_s']:>13.2f}s{m['takeover_max_s']:>7.2f}s"
              f"{m['acked']:>8}{m['lost']:>6}{m['wrong']:>7}")
    stops = results["scenarios"]["ha-sigstop"]["trials"]
    print(f"frozen leaders that woke up: exit codes {[r.get('deposed_exit') for r in stops]}"
          " (3 = refused and exited)")
    print("\n64 KiB put, queue depth 1 (tcp)")
    for name, r in results["put_64k_qd1"].items():
        print(f"{name:<18}p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms")
    ok = all(s["summary"]["lost"] == 0 and s["summary"]["wrong"] == 0
             for s in results["scenarios"].values())
    kill = results["scenarios"]["ha-kill9"]["summary"]
    print(f"\ntargets: takeover <= 3 s: {'met' if kill['takeover_max_s'] <= 3 else 'MISSED'}"
          f" (max {kill['takeover_max_s']:.2f} s); acknowledged puts lost 0 and wrong bytes 0:"
          f" {'met' if ok else 'MISSED'}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
