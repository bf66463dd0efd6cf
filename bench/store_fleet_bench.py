#!/usr/bin/env python3
"""The store for a fleet (issue 22's table), measured on the multi-host test bed.

Every row is its own `Testbed` (each component on an emulated host with its own address, IPC
namespace and tbf-shaped link) with a store master on host `master`, and its baseline in the
same run:

1. hot prefix: a 64-block prefix stored on one host (`src`); 3 reader hosts, each a process
   serving its own storage segment (as workers do) with 2 reader clients, read it in a loop at
   1 Gbit/s: aggregate read rate with the master's hot-object fan-out on vs off;
2. checkpoint: 6 hosts fetch a 512 MiB directory from one source at 1 Gbit/s at once: time
   until all have it, `mooncake p2p get` vs every host copying from the source alone (an HTTP
   server on the source host: one link shared by all);
3. model to pods: the first pod fetches the model directory, then 3 later pods at once:
   their times through `mooncake p2p get` vs copies from the source host;
4. tenants: tenant B's hit rate on its own working set while tenant A floods puts at 3x its
   quota: B alone, the flood without quotas, the flood with quotas;
5. restart: a storage node with 1 GiB on its SSD tier killed with SIGKILL and started again with
   the same directory: objects served again (read back and verified) and the time to re-adopt.

A row whose feature has not landed (no fan-out switch, no `mooncake p2p`, no tenant on puts or
quota setting on the master) says "not measured: <why>" and keeps its baseline.

Each host's work runs in a process spawned on it (`store_fleet_worker.py SPEC`, a JSON file
naming the role; the bed itself is `store_fleet_bed.py`): gRPC's I/O threads would not follow
`Host.call`'s namespace switch. Processes meet through files in the run's work directory (a
"go" file starts every timed phase at once).

Usage: python bench/store_fleet_bench.py [--rows 1,2,3,4,5] [--tiny | --scale F]
(the full sizes take about 10-15 min on a quiet 2-core box; --tiny is a quick dry run).
Needs root and network namespaces (docs/testbed.md). Writes bench/results/store_fleet_bench.json
and .txt.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script: make the `bench` package importable (appended: the repo root holds an
# `operator/` directory that must not shadow the standard library).
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.multihost_bench import BENCH_DIR, _met, render
from bench.store_fleet_bed import (
    CLI,
    LINK_BPS,
    RATE,
    Fleet,
    Sizes,
    fanout_args,
    fleet,
    p2p_present,
    quota_args,
    tenant_put_ok,
)
from mooncake_k8s.transfer.segments import cluster_tag

MiB = 1 << 20


# -- rows -----------------------------------------------------------------------------------


def attempt(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """One configuration of a row; its failure is recorded (and printed), so the row's other
    configuration (the baseline, say) still counts."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"    failed: {e!r}")
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def row_hot(sz: Sizes, echo: Callable[[str], None]) -> dict[str, Any]:
    """Row 1: the aggregate read rate of 6 readers on 3 hosts, fan-out off and on."""
    out: dict[str, Any] = {"blocks": sz.blocks, "block_bytes": sz.block}
    configs = [("off", fanout_args(False)), ("on", fanout_args(True))]
    for label, margs in configs:
        if margs is None:
            out[label] = {"not_measured": "the master has no fan-out switch"}
            if label == "off":
                out[label] = attempt(_hot_run, sz, [], echo)  # no switch: the baseline
                out[label]["note"] = "master without fan-out"
            continue
        out[label] = attempt(_hot_run, sz, margs, echo)
    return out


def _hot_run(sz: Sizes, margs: list[str], echo: Callable[[str], None]) -> dict[str, Any]:
    echo(f"  [hot] master {' '.join(margs) or '(defaults)'}")
    seg = sz.block * sz.blocks * 2 + 16 * MiB
    with fleet("hot", margs) as f:
        f.worker("src", "src", "hold", node_dram=seg, keys=sz.blocks, size=sz.block)
        f.wait_ready(["src"], sz.timeout_s)
        readers = [f"r{i}" for i in range(3)]
        for r in readers:
            f.worker(r, r, "read", node_dram=seg, clients=2, keys=sz.blocks, size=sz.block,
                     duration=sz.read_s)
        f.wait_ready(readers, sz.timeout_s)
        before = f.bed.counters()
        f.go()
        res = {r: f.result(r, sz.timeout_s + sz.read_s) for r in readers}
        after = f.bed.counters()
        fan = f.master_samples("mooncake_store_fanout")
    total = sum(r["bytes"] for r in res.values())
    secs = max(r["seconds"] for r in res.values())
    late = sum(r["bytes_late"] for r in res.values())
    run = {"readers": res, "bytes": total, "seconds": secs, "rate_Bps": total / secs,
           "late_rate_Bps": late / max(1e-9, secs - sz.read_s / 2),
           "src_sent": after["src"][0] - before["src"][0],
           "wrong": sum(r["wrong"] for r in res.values()), "master_fanout": fan}
    echo(f"    aggregate {run['rate_Bps'] / MiB:.1f} MiB/s (second half "
         f"{run['late_rate_Bps'] / MiB:.1f} MiB/s), src sent "
         f"{run['src_sent'] / MiB:.1f} MiB, wrong {run['wrong']}")
    return run


def make_dir(path: Path, total: int, files: int = 4) -> None:
    """A checkpoint-like directory of `files` files of random bytes, `total` in all."""
    path.mkdir(parents=True, exist_ok=True)
    each = total // files
    for i in range(files):
        with open(path / f"shard-{i:02d}.bin", "wb") as fh:
            left = each
            while left:
                n = min(left, 8 * MiB)
                fh.write(os.urandom(n))
                left -= n


def row_checkpoint(sz: Sizes, echo: Callable[[str], None]) -> dict[str, Any]:
    """Row 2: time until all fetchers have the checkpoint: P2P vs the source alone."""
    work = Path(tempfile.mkdtemp(prefix="fleet-ckpt-"))
    src = work / "checkpoint"
    make_dir(src, sz.checkpoint)
    out: dict[str, Any] = {"bytes": _dir_bytes(src), "fetchers": sz.fetchers}
    hosts = [f"h{i}" for i in range(sz.fetchers)]
    echo("  [checkpoint] source alone")
    out["source"] = attempt(_fetch_run, sz, src, [hosts], "http", echo)
    out["p2p"] = (attempt(_fetch_run, sz, src, [hosts], "p2p", echo) if p2p_present()
                  else {"not_measured": "no `mooncake p2p` command"})
    # the same P2P fetch with unshaped links: the floor this box's 2 cores set (every emulated
    # host's receive, verify, keep, write and serve share them), to tell it from the links'
    echo("  [checkpoint] p2p, links unshaped (the box's CPU floor)")
    out["p2p_unshaped"] = attempt(_fetch_run, sz, src, [hosts], "p2p", echo, None)
    shutil.rmtree(work, ignore_errors=True)
    return out


def row_model(sz: Sizes, echo: Callable[[str], None]) -> dict[str, Any]:
    """Row 3: a pod's model: the first pod from the source, later pods through P2P or the
    source (the later ones at once, as a scale-out does)."""
    if sz.model_dir == "synthetic":
        model = Path(tempfile.mkdtemp(prefix="fleet-model-")) / "model"
        make_dir(model, sz.checkpoint // 2, files=3)
    else:
        from mooncake_k8s.engine.loading import ensure_builtin

        model, _sha = ensure_builtin(progress=False)  # the model `mooncake up` serves
    out: dict[str, Any] = {"model": str(model), "bytes": _dir_bytes(model)}
    waves = [["pod0"], [f"pod{i + 1}" for i in range(sz.later_pods)]]
    echo("  [model] from the source")
    out["source"] = attempt(_fetch_run, sz, model, waves, "http", echo)
    out["p2p"] = (attempt(_fetch_run, sz, model, waves, "p2p-cli", echo) if p2p_present()
                  else {"not_measured": "no `mooncake p2p` command"})
    return out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fetch_run(sz: Sizes, src: Path, waves: list[list[str]], how: str,
               echo: Callable[[str], None], rate: str | None = RATE) -> dict[str, Any]:
    """Each wave of hosts fetches `src` at once (after the previous wave): per host seconds
    from the common start to its last byte, and bytes verified."""
    with fleet(f"fetch-{how}", rate=rate) as f:
        node_dram = int(_dir_bytes(src) * 1.15) + 32 * MiB
        if how == "http":
            f.worker("src", "src", "http_serve", dir=str(src))
        else:
            f.worker("src", "src", "p2p_publish", dir=str(src), p2p_name="ckpt",
                     node_dram=node_dram)
        f.wait_ready(["src"], sz.timeout_s)
        names = {f.result("src", 5).get("host_id"): "src"} if how == "p2p" else {}
        waves_out = []
        for n, wave in enumerate(waves):
            with contextlib.suppress(FileNotFoundError):
                (f.work / "go").unlink()
            for h in wave:
                dest = str(f.work / f"{h}-dir")
                if how == "http":
                    url = f"http://{f.host('src').addr}:{f.port + 5}"
                    f.worker(h, h, "http_get", url=url, dir=dest, files=_manifest(src))
                elif how == "p2p":  # in process: the host's node and the fetcher share its id
                    f.worker(h, h, "p2p_get", dir=dest, p2p_name="ckpt", node_dram=node_dram)
                else:  # the command a pod's init container runs, its node beside it
                    f.store_node(f"{h}-node", h, node_dram)
                    f.worker(h, h, "cmd", argv=[
                        *CLI, "p2p", "get", "ckpt", dest, "--master", f.master,
                        "--keep-on", f"{h}-node-dram-0"])
            f.wait_ready(wave, sz.timeout_s)
            before = f.bed.counters()
            f.go()
            res = {h: f.result(h, sz.timeout_s) for h in wave}
            after = f.bed.counters()
            sent = {h: after[h][0] - before[h][0] for h in after}  # who served the bytes
            names.update({r.get("host_id"): h for h, r in res.items()})
            for r in res.values():  # chunks by the emulated host that served them
                if "by_host" in r:
                    r["by_host"] = {names.get(k, k): v for k, v in r["by_host"].items()}
            for h in wave:
                res[h]["verified"] = _same_dir(src, f.work / f"{h}-dir")
                shutil.rmtree(f.work / f"{h}-dir", ignore_errors=True)  # GBs at full size
            secs = max(r["seconds"] for r in res.values())
            echo(f"    {how} wave {n}: all {len(wave)} in {secs:.2f}s, verified "
                 f"{sum(r['verified'] for r in res.values())}/{len(wave)}, source sent "
                 f"{sent['src'] / MiB:.0f} MiB")
            waves_out.append({"hosts": res, "all_s": secs, "sent_bytes": sent})
    return {"waves": waves_out}


def _manifest(src: Path) -> list[str]:
    return sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())


def _same_dir(a: Path, b: Path) -> bool:
    names = _manifest(a)
    if not b.exists() or _manifest(b) != names:
        return False
    return all(_same_file(a / n, b / n) for n in names)


def _same_file(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(4 * MiB), fb.read(4 * MiB)
            if x != y:
                return False
            if not x:
                return True


def row_tenants(sz: Sizes, echo: Callable[[str], None]) -> dict[str, Any]:
    """Row 4: tenant B's hit rate on its working set (40% of the pool): alone, with tenant A
    putting 3x its quota (40% of the pool) without quotas, and with quotas."""
    quota = int(sz.pool * 0.4)
    out: dict[str, Any] = {"pool": sz.pool, "quota_a": quota, "working_set_b": quota}
    out["alone"] = attempt(_tenant_run, sz, [], 0, echo)
    out["no_quota"] = attempt(_tenant_run, sz, [], 3 * quota, echo)
    margs = quota_args("a", quota)
    if margs is None or not tenant_put_ok():
        out["quota"] = {"not_measured": "no quota setting on the master"
                        if margs is None else "puts carry no tenant"}
    else:
        out["quota"] = attempt(_tenant_run, sz, [*margs, *(quota_args("b", quota) or [])],
                               3 * quota, echo)
    return out


def _tenant_run(sz: Sizes, margs: list[str], flood: int,
                echo: Callable[[str], None]) -> dict[str, Any]:
    echo(f"  [tenants] flood {flood / MiB:.0f} MiB, master {' '.join(margs) or '(defaults)'}")
    with fleet("tenants", margs) as f:
        f.store_node("pool", "store", sz.pool)
        n_b = int(sz.pool * 0.4) // sz.tenant_object
        tenant = tenant_put_ok()
        f.worker("b", "tenant-b", "tenant_b", keys=n_b, size=sz.tenant_object,
                 tenant="b" if tenant else "")
        f.worker("a", "tenant-a", "flood", bytes=flood, size=sz.tenant_object,
                 tenant="a" if tenant else "")
        f.wait_ready(["b", "a"], sz.timeout_s)
        f.go()
        a = f.result("a", sz.timeout_s)
        (f.work / "flood-done").write_text("")
        b = f.result("b", sz.timeout_s)
        tenants = f.master_samples("mooncake_store_tenant")
    echo(f"    B hit rate during {b['during_hit']:.3f}, after {b['after_hit']:.3f}; "
         f"A put {a['acked']}/{a['puts']}")
    return {"b": b, "a": a, "master_tenants": tenants}


def row_restart(sz: Sizes, echo: Callable[[str], None]) -> dict[str, Any]:
    """Row 5: SIGKILL a node holding `ssd_bytes` on SSD, start it again on the same directory:
    the objects served again and the time until the master lists them."""
    n = (sz.ssd_bytes + sz.ssd_dram) // sz.ssd_object  # DRAM fills, the rest spills to SSD
    with fleet("restart") as f:
        ssd = f.work / "ssd"
        ssd_args = ["--ssd-dir", str(ssd), "--ssd-size", str(int(sz.ssd_bytes * 1.25))]
        f.store_node("node", "store", sz.ssd_dram, *ssd_args)
        f.worker("fill", "client", "fill", keys=n, size=sz.ssd_object)
        fill = f.result("fill", sz.timeout_s)
        echo(f"  [restart] {fill['acked']} objects put, SSD used {fill['ssd_used'] / MiB:.0f} MiB"
             f" of them, DRAM {fill['dram_used'] / MiB:.0f} MiB")
        t0 = time.time()
        f.worker("check", "client", "check", keys=n, size=sz.ssd_object, t0=t0,
                 settle_s=min(20.0, sz.timeout_s / 4))
        f.wait_ready(["check"], sz.timeout_s)  # started now: its start-up is not timed
        f.kill("node")
        t0 = time.time()
        (f.work / "t0").write_text(str(t0))
        f.spawn("node", "store", f.args["node"])
        try:  # the master lists the dead node's objects until it re-registers: wait for that
            reg_s: float | None = f.wait_registered("node", "store", sz.timeout_s)
        except (RuntimeError, TimeoutError):
            reg_s = None
        started = f.procs["node"].poll() is None
        shm = _shm_bytes(f)  # the dead node's DRAM segment reclaimed, not a second one
        f.go()
        chk = f.result("check", sz.timeout_s + 60)
        started = started and f.procs["node"].poll() is None
        out = {"objects": n, "fill": fill, "check": chk, "node_started": started,
               "registered_s": reg_s, "shm_bytes_after": shm, "dram_size": sz.ssd_dram,
               "node_log_tail": "" if started else f.tail("node", 400)}
        f.kill("node", signal.SIGTERM)
        shutil.rmtree(ssd, ignore_errors=True)
    echo(f"    /dev/shm after the restart: {shm / MiB:.0f} MiB (one node's DRAM "
         f"{sz.ssd_dram / MiB:.0f} MiB)")
    echo(f"    node {'started' if started else 'did NOT start'} (registered after {reg_s}s); "
         f"listed again {chk['listed']}, served verified {chk['verified']} (wrong "
         f"{chk['wrong']}), listed by {chk['adopt_s']}s")
    return out


def _shm_bytes(f: Fleet) -> int:
    """Bytes of this bed's cluster's segment files in /dev/shm."""
    tag = cluster_tag([f.master])
    return sum(os.stat(p).st_size for p in glob.glob(f"/dev/shm/mooncake-{tag}-*"))


ROWS: dict[int, tuple[str, Callable[[Sizes, Callable[[str], None]], dict[str, Any]]]] = {
    1: ("hot", row_hot), 2: ("checkpoint", row_checkpoint), 3: ("model", row_model),
    4: ("tenants", row_tenants), 5: ("restart", row_restart)}


# -- the table ------------------------------------------------------------------------------


def table(res: dict[str, Any]) -> list[list[str]]:
    """The issue's table from whatever rows ran; a failed or missing row says why."""
    rows = [["measure", "target", "ours", "baseline", "met"]]
    for name, fn in TABLE_ROWS:
        if name not in res:
            continue
        if "error" in res[name]:
            rows.append([name, "-", NM + res[name]["error"][:120], "-", "-"])
            continue
        try:
            rows.append(fn(res[name]))
        except (KeyError, TypeError, ZeroDivisionError) as e:
            rows.append([name, "-", f"{NM}incomplete result ({e!r})", "-", "-"])
    return rows


NM = "not measured: "


def _why(d: dict[str, Any]) -> str:
    return NM + str(d.get("not_measured", d.get("error", "?")))


def _t_hot(h: dict[str, Any]) -> list[str]:
    base, on = h["off"].get("rate_Bps"), h["on"].get("rate_Bps")
    b = f"{base / MiB:.0f} MiB/s" if base else _why(h["off"])
    o = f"{on / MiB:.0f} MiB/s ({on / base:.2f}x)" if on and base else _why(h["on"])
    if on and base and h["on"].get("late_rate_Bps"):
        late, late0 = h["on"]["late_rate_Bps"], h["off"]["late_rate_Bps"]
        o += f"; second half {late / MiB:.0f} vs {late0 / MiB:.0f} MiB/s ({late / late0:.2f}x)"
    return ["6 readers/3 hosts, hot 64-block prefix on one host, 1 Gbit/s: aggregate rate, "
            "fan-out vs none", ">= 2x", o, b, _met(on / base >= 2) if on and base else "-"]


def _t_checkpoint(c: dict[str, Any]) -> list[str]:
    ideal = c["bytes"] / LINK_BPS

    def all_s(d: dict[str, Any]) -> str:
        if "waves" not in d:
            return _why(d)
        s = d["waves"][0]["all_s"]
        return f"{s:.1f}s = {s / ideal:.1f}x size/rate"
    p2p = c["p2p"].get("waves")
    ours = all_s(c["p2p"])
    if "p2p_unshaped" in c:
        ours += f"; links unshaped (CPU floor) {all_s(c['p2p_unshaped'])}"
    return [f"{c['fetchers']} hosts fetch {c['bytes'] / MiB:.0f} MiB from one source, 1 Gbit/s: "
            "time until all have it", "<= 2x size/rate", ours, all_s(c["source"]),
            _met(p2p[0]["all_s"] <= 2 * ideal) if p2p else "-"]


def _t_model(m: dict[str, Any]) -> list[str]:
    def later(d: dict[str, Any]) -> str:
        if "waves" not in d:
            return _why(d)
        times = [r["seconds"] for r in d["waves"][1]["hosts"].values()]
        return (f"later pods {min(times):.1f}-{max(times):.1f}s "
                f"(first {d['waves'][0]['all_s']:.1f}s)")
    return [f"a pod's model ({m['bytes'] / MiB:.0f} MiB) through P2P vs from the source, "
            "second and later pods", "report", later(m["p2p"]), later(m["source"]), "-"]


def _t_tenants(t: dict[str, Any]) -> list[str]:
    def hit(d: dict[str, Any]) -> float | None:
        return float(d["b"]["after_hit"]) if "b" in d else None
    alone, flood, q = hit(t["alone"]), hit(t["no_quota"]), hit(t["quota"])
    o = f"{q:.3f} (alone {alone:.3f})" if q is not None and alone is not None else \
        _why(t["quota"])
    b = f"{flood:.3f} (alone {alone:.3f})" if flood is not None and alone is not None \
        else _why(t["no_quota"])
    return ["tenant A puts 3x its quota: tenant B's hit rate on its working set",
            "within 5% of B alone", o, b,
            _met(alone - q <= 0.05 * alone) if q is not None and alone else "-"]


def _t_restart(r: dict[str, Any]) -> list[str]:
    ck = r["check"]
    adopt = f"{ck['adopt_s']:.1f}s" if ck["adopt_s"] is not None else "never"
    reg = f"{r['registered_s']:.1f}s" if r.get("registered_s") is not None else "never"
    o = (f"{ck['verified']}/{r['fill']['acked']} objects served verified ({ck['wrong']} "
         f"wrong; {r['fill']['ssd_objects']} were on SSD), registered again in {reg}, "
         f"listed by {adopt}; /dev/shm {r['shm_bytes_after'] / MiB:.0f} MiB for a "
         f"{r['dram_size'] / MiB:.0f} MiB node" if r["node_started"]
         else f"node did not start: {r['node_log_tail'][-160:]}")
    return [f"node restarted with {r['fill']['ssd_used'] / MiB:.0f} MiB on SSD: objects served "
            "again, time to re-adopt", "all verified ones; report", o, "-", "-"]


TABLE_ROWS: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = [
    ("hot", _t_hot), ("checkpoint", _t_checkpoint), ("model", _t_model),
    ("tenants", _t_tenants), ("restart", _t_restart)]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: a dry run")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="every byte count times this (a dry run at some scale)")
    ap.add_argument("--out", default=str(BENCH_DIR / "results" / "store_fleet_bench"))
    args = ap.parse_args()
    sz = Sizes.tiny() if args.tiny else Sizes().scaled(args.scale) if args.scale != 1 \
        else Sizes()
    res: dict[str, Any] = {
        "bench": "store_fleet_bench", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                   f"kernel {platform.release()}", "tiny": args.tiny, "scale": args.scale,
        "sizes": sz.__dict__, "commit": _commit()}
    for n in (int(x) for x in args.rows.split(",")):
        name, fn = ROWS[n]
        print(f"[row {n}] {name}")
        try:
            res[name] = fn(sz, print)
        except Exception as e:  # one row's failure is reported, the others still run
            print(f"  row {n} failed: {e!r}")
            res[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    try:
        text = render(table(res))
    except Exception as e:  # a row's result missing a field: keep the JSON anyway
        text = f"(table failed: {e!r})"
    print(text)
    Path(args.out + ".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    Path(args.out + ".txt").write_text(f"{res['machine']}, {res['date']}, commit "
                                       f"{res['commit']}{' (tiny)' if args.tiny else ''}"
                                       f"{f' (scale {args.scale})' if args.scale != 1 else ''}"
                                       f"\n\n{text}\n")
    return 0


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=BENCH_DIR, timeout=10).stdout.strip()
    return "?"


if __name__ == "__main__":
    sys.exit(main())
