#!/usr/bin/env python3
"""Pods come and go (issue 23's table), measured on the multi-host test bed with the real model.

One `BedCluster` (master, store node, 2 prefill hosts, 2 decode hosts, the Conductor; each host
its own address, IPC namespace and 1 Gbit/s link; one engine thread per worker) serves
SmolLM2-135M at temperature 0. Streams are `/v1/completions` with `ignore_eos` (exactly T tokens
each), one SSE chunk per token, every chunk's arrival timed (`drain_streams.py`).

Rows 1-3, drain. N streams of T tokens, all on one decode: while they are routed the other decode
is frozen (SIGSTOP: the Conductor's polls find it unreachable) and then resumed and back in
rotation. Once every stream has T/10 tokens the decode gets SIGTERM; workers run with
`--drain-timeout G`. Measured: broken streams (an error, or not exactly T tokens), text and
tokens against an undisturbed run of the same prompts (a token streamed twice is an extra
chunk), and which streams were handed over (on the drained decode, last token after it
exited). A stream's stall = the largest gap between two of its tokens after the signal. The
failover path is the same workload (other prompts, so nothing the drain stored helps it) with
the decode killed by SIGKILL instead, in the same run. Tokens recomputed per moved stream = the
prefill hosts' `mooncake_prefill_tokens_total{source="computed"}` growth from the signal to
the end over the streams moved (a handoff resumes with no prefill call; failover re-prefills the
prompt's partial block and every streamed token); every series of the Conductor and workers
named like handoff/recompute/resume/stall/reroute/drain is recorded too (deltas, in the JSON).

Row 4, hung. The same workload routed as the Conductor likes; the decode of stream 0 frozen
(SIGSTOP) for F s, then SIGCONT, and separately its link cut for F s, then healed: per stream
on it, the time from the fault to the token that ended its largest gap, and broken streams.

Row 5, warm. K prompts of about P tokens, each sent, then repeated (the repeat's prefill
instance is the holder: its host holds the prefix); the Conductor killed with SIGKILL and
started again; the first repeat after it is ready: its prefill instance and cached tokens.

A row whose feature has not landed says "not measured: <why>": checked at run time (the
workers' `--drain-timeout` flag). Rows 4 and 5 measure what exists either way (before issue 23:
streams stall for the whole freeze; a restarted Conductor is blind).

Usage: python bench/drain_bench.py [--rows 1,2,3,4,5] [--quick] [--stall-timeout S]
Order: drain (then the undisturbed run), SIGSTOP, partition, Conductor restart, and last the
kill -9 (its decode is not started again). Full: about 7 min on a quiet 2-core box (an
estimate; the loaded box's --quick took 7 min); --quick (4 streams of 80 tokens, 1 s grace,
4 s faults, one 500-token prompt) is a dry run of every row. Needs root and network namespaces
(docs/testbed.md). Writes bench/results/drain_bench.json and .txt (--quick: drain_bench-quick).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Run as a script: make the `bench` package importable (appended: the repo root holds an
# `operator/` directory that must not shadow the standard library).
if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.drain_streams import Workload, deltas, scrape, stream_prompt, total
from bench.drain_table import FULL, QUICK, Plan, describe, fmt_s, summary, table
from bench.multihost_bench import BENCH_DIR, prompt, render, stream_chat
from mooncake_k8s.testbed import Testbed
from mooncake_k8s.testbed.cluster import BedCluster, BedConfig

COMPUTED = ("mooncake_prefill_tokens_total", 'source="computed"')


# -- what exists ------------------------------------------------------------------------------


def _help(cmd: str) -> str:
    out = subprocess.run([sys.executable, "-m", "mooncake_k8s.cli", cmd, "--help"],
                         capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "PYTHONSAFEPATH": "1"})
    return out.stdout + out.stderr


def commit() -> str:
    """The tree measured: HEAD, "+dirty" when files differ from it (others' work under way)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, check=False,
                              cwd=BENCH_DIR.parent).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def features() -> dict[str, bool]:
    """Which of issue 23's pieces this tree has (flags and wire fields), read at run time."""
    from mooncake_k8s.common.rpc import serving_pb2, store_pb2

    return {"drain_timeout": "--drain-timeout" in _help("decode"),
            "stream_stall_timeout": "--stream-stall-timeout" in _help("conductor"),
            "handoff_chunk": "handoff" in serving_pb2.DecodeChunk.DESCRIPTOR.fields_by_name,
            "snapshot_watch": "snapshot" in store_pb2.WatchRequest.DESCRIPTOR.fields_by_name}


# -- the cluster ------------------------------------------------------------------------------


class DrainCluster(BedCluster):
    """A `BedCluster` whose workers and Conductor take extra flags, and whose Conductor can be
    killed and started again with the same command line."""

    def __init__(self, bed: Testbed, config: BedConfig, worker_extra: list[str],
                 conductor_extra: list[str], echo: Callable[[str], None]) -> None:
        super().__init__(bed, config, echo=echo)
        self.worker_extra, self.conductor_extra = worker_extra, conductor_extra
        self.conductor_argv: list[str] = []

    def worker_args(self, name: str) -> list[str]:
        return [*super().worker_args(name), *self.worker_extra]

    def _spawn(self, name: str, args: list[str]) -> None:
        if name == "conductor":
            args = self.conductor_argv = [*args, *self.conductor_extra]
        super()._spawn(name, args)

    @property
    def decodes(self) -> list[str]:
        return [n for n in self.workers if n.startswith("decode")]

    @property
    def prefills(self) -> list[str]:
        return [n for n in self.workers if not n.startswith("decode")]

    def host_of(self, instance: str) -> str:
        """The bed host of an instance named by id, address or host:port."""
        for n in self.workers:
            if instance in (n, self.addr(n), self.hosts[n].addr):
                return n
        return instance

    def restart_conductor(self) -> None:
        self.kill("conductor")
        BedCluster._spawn(self, "conductor", self.conductor_argv)
        self.wait_ready(["conductor"])


class Bench:
    def __init__(self, c: DrainCluster, plan: Plan, echo: Callable[[str], None]) -> None:
        self.c, self.plan, self._echo = c, plan, echo
        self.nonce = f"{int(time.time()) % 100000}"
        self.t0 = time.monotonic()

    def echo(self, msg: str) -> None:
        self._echo(f"{time.monotonic() - self.t0:6.0f}s {msg}")

    def ready(self, role: str) -> float:
        return total(scrape(self.c, "conductor"), "mooncake_conductor_instances",
                     f'role="{role}",state="ready"')

    def wait_ready_count(self, role: str, n: int, timeout: float = 180.0) -> None:
        """Until the Conductor routes to exactly `n` instances of `role`."""
        deadline = time.monotonic() + timeout
        while self.ready(role) != n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Conductor never counted {n} {role} instances ready "
                                   f"(now {self.ready(role):.0f})")
            time.sleep(0.2)

    def wait_routed(self) -> None:
        self.wait_ready_count("prefill", len(self.c.prefills))
        self.wait_ready_count("decode", len(self.c.decodes))

    def prompts(self, tag: str) -> list[str]:
        return [stream_prompt(f"{tag}{self.nonce}", i, self.plan.prompt_words)
                for i in range(self.plan.streams)]

    def snapshot(self, skip: str = "") -> dict[str, dict[str, float]]:
        return {n: scrape(self.c, n) for n in ["conductor", *self.c.workers] if n != skip}

    def computed(self, snap: dict[str, dict[str, float]]) -> float:
        return sum(total(snap.get(p, {}), *COMPUTED) for p in self.c.prefills)

    def signal_group(self, name: str, sig: int) -> None:
        os.killpg(self.c.procs[name].pid, sig)

    def reference(self, prompts: list[str]) -> list[list[str]]:
        """Every prompt's tokens (chunk texts) from an undisturbed run."""
        wl = Workload(self.c, prompts, self.plan.tokens, self.plan.client_timeout_s).start()
        wl.join()
        bad = [s.index for s in wl.streams if not s.complete(self.plan.tokens)]
        if bad:
            raise RuntimeError(f"the undisturbed run broke streams {bad}: "
                               f"{wl.streams[bad[0]].error or 'short'}")
        return [s.pieces for s in wl.streams]


# -- one disturbed run ------------------------------------------------------------------------


class Fault:
    """One way of losing a decode mid-stream; `apply` at the signal, `settle` after the run."""

    def __init__(self, b: Bench, kind: str, victim: str) -> None:
        self.b, self.kind, self.victim = b, kind, victim
        self.exited_at: float | None = None
        self._thread: threading.Thread | None = None

    def apply(self) -> None:
        c, p = self.b.c, self.b.c.procs[self.victim]
        if self.kind == "drain":
            self.b.signal_group(self.victim, signal.SIGTERM)
            self._background(lambda: self._exit_of(p))
        elif self.kind == "kill":
            c.kill(self.victim)
            self._exited()
        elif self.kind == "sigstop":
            self.b.signal_group(self.victim, signal.SIGSTOP)
            self._background(lambda: self._later(
                lambda: self.b.signal_group(self.victim, signal.SIGCONT)))
        elif self.kind == "partition":
            host = c.hosts[self.victim]
            host.set_link(up=False)
            self._background(lambda: self._later(lambda: host.set_link(up=True)))
        else:
            raise ValueError(self.kind)

    def _exit_of(self, p: subprocess.Popen[bytes]) -> None:
        p.wait()
        self._exited()

    def _exited(self) -> None:
        self.exited_at = time.monotonic()

    def _later(self, fn: Callable[[], None]) -> None:
        time.sleep(self.b.plan.fault_s)
        fn()

    def _background(self, fn: Callable[[], object]) -> None:
        self._thread = threading.Thread(target=fn, daemon=True)
        self._thread.start()

    def settle(self, restore: bool) -> None:
        """Undo the fault: the decode healed (or, with `restore`, a new one started and in
        rotation; the run's last part leaves a killed decode dead)."""
        b = self.b
        if self._thread is not None:
            self._thread.join(b.plan.grace_s + b.plan.fault_s + 60)
        if not restore:
            return
        if self.kind in ("drain", "kill"):
            b.c.respawn([self.victim])
        b.wait_routed()


def disturbed(b: Bench, kind: str, prompts: list[str], pin: bool,
              restore: bool = True) -> dict[str, Any]:
    """Run the workload, lose a decode mid-stream with `kind`, and describe every stream."""
    c, plan = b.c, b.plan
    victim = c.decodes[0] if pin else ""
    others = [d for d in c.decodes if d != victim] if pin else []
    for d in others:  # while the streams are routed, the victim is the only decode
        b.signal_group(d, signal.SIGSTOP)
    try:
        if others:
            b.wait_ready_count("decode", len(c.decodes) - len(others))
        wl = Workload(c, prompts, plan.tokens, plan.client_timeout_s).start()
        wl.wait_tokens(1)
    finally:
        for d in others:
            b.signal_group(d, signal.SIGCONT)
    b.wait_ready_count("decode", len(c.decodes))
    for st in wl.streams:  # the header names the instance: its bed host's name here
        st.decode = c.host_of(st.decode)
    victim = victim or wl.streams[0].decode
    mine = [s for s in wl.streams if s.decode == victim]
    wl.wait_tokens(max(1, plan.tokens // 10), mine)
    before = b.snapshot(skip=victim)
    fault = Fault(b, kind, victim)
    t_sig = time.monotonic()
    fault.apply()
    b.echo(f"  [{kind}] {victim} hit with {len(mine)} of {len(wl.streams)} streams on it")
    wl.join()
    after = b.snapshot(skip=victim)  # gone, frozen or cut off: nothing counted there
    fault.settle(restore)
    pivot = (fault.exited_at if fault.exited_at is not None
             else t_sig + (plan.grace_s if kind == "drain" else 0.0))
    streams = [describe(s, victim, t_sig, pivot, plan.tokens) for s in wl.streams]
    out: dict[str, Any] = {"kind": kind, "victim": victim, "pinned": pin, "streams": streams,
           "exited_after_s": (fault.exited_at - t_sig) if fault.exited_at else None,
           "prefill_computed": b.computed(after) - b.computed(before),
           "metric_deltas": deltas(before, after), "load1": os.getloadavg()[0]}
    out.update(summary(out, plan.tokens))
    b.echo(f"  [{kind}] moved {out['moved']}, broken {out['broken']}, stall p50 "
           f"{fmt_s(out['stall_p50_s'])} max {fmt_s(out['stall_max_s'])}, flow again max "
           f"{fmt_s(out['flow_max_s'])}, prefill computed {out['prefill_computed']:.0f}")
    return out


# -- the parts --------------------------------------------------------------------------------


def drain_part(b: Bench, feats: dict[str, bool]) -> dict[str, Any]:
    if not feats["drain_timeout"]:
        return {"not_measured": "workers have no --drain-timeout flag yet (the handoff "
                                "area's), so no drain with a 5 s grace to measure"}
    prompts = b.prompts("dr")
    out = disturbed(b, "drain", prompts, pin=True)
    # The undisturbed run comes after: run first, it would leave the prompts' blocks on the
    # decode that `disturbed` freezes while routing, and a prefix read from a frozen host
    # waits out the transfer timeout.
    b.echo("  [drain] the undisturbed run of the same prompts")
    try:
        ref = b.reference(prompts)
    except Exception as e:  # the drain's numbers stand; equality is then unknown
        out["reference_error"] = f"{type(e).__name__}: {e}"
        out["text_equal"] = out["tokens_equal"] = None
        return _strip(out)
    for st in out["streams"]:
        st["text_equal"] = st["text"] == "".join(ref[st["index"]])
        st["tokens_equal"] = st["pieces"] == ref[st["index"]]
        if not st["text_equal"]:
            st["reference"] = "".join(ref[st["index"]])
    out["text_equal"] = sum(st["text_equal"] for st in out["streams"])
    out["tokens_equal"] = sum(st["tokens_equal"] for st in out["streams"])
    return _strip(out)


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    """The JSON keeps a stream's text only where it differs from the undisturbed run's."""
    for st in run["streams"]:
        st.pop("pieces", None)
        if st.get("text_equal", True):
            st.pop("text", None)
    return run


def failover_part(b: Bench) -> dict[str, Any]:
    """Last in the run: the killed decode stays dead (a respawn would cost a model load)."""
    return _strip(disturbed(b, "kill", b.prompts("fo"), pin=True, restore=False))


def hung_part(b: Bench, kind: str) -> dict[str, Any]:
    return _strip(disturbed(b, kind, b.prompts(kind[:2]), pin=False))


def restart_part(b: Bench) -> dict[str, Any]:
    c, plan = b.c, b.plan
    texts = [prompt(f"warm{b.nonce}x{i}", plan.restart_tokens)
             for i in range(plan.restart_prompts)]

    def chat(text: str) -> dict[str, Any]:
        r = c.client_call(stream_chat, c.base_url, text, 4)
        keep = ("prefill", "decode", "cached_tokens", "ttft_s")
        return {**{k: r[k] for k in keep}, "prompt_tokens": r["usage"].get("prompt_tokens", 0)}

    cold = [chat(t) for t in texts]
    held = [chat(t) for t in texts]  # the repeat before the restart: who holds the prefix
    t0 = time.monotonic()
    c.restart_conductor()
    b.wait_routed()
    restart_s = time.monotonic() - t0
    after = [chat(t) for t in texts]  # after[0] is the first request the new Conductor sees
    for a, h in zip(after, held, strict=True):
        a["holder"] = h["prefill"]
        a["routed_to_holder"] = a["prefill"] == h["prefill"]
        a["cached_share"] = a["cached_tokens"] / a["prompt_tokens"] if a["prompt_tokens"] else 0
    b.echo(f"  [restart] first repeat: {after[0]['prefill']} (holder {after[0]['holder']}), "
           f"cached {after[0]['cached_tokens']}/{after[0]['prompt_tokens']}")
    return {"cold": cold, "held": held, "after": after, "restart_s": restart_s,
            "first": after[0]}


def attempt(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A part's result, or why it failed (the other parts still run)."""
    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


# -- main ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, plan: Plan, feats: dict[str, bool],
        echo: Callable[[str], None]) -> dict[str, Any]:
    worker_extra = ["--drain-timeout", f"{plan.grace_s:g}"] if feats["drain_timeout"] else []
    conductor_extra = ([] if args.stall_timeout is None
                       else ["--stream-stall-timeout", f"{args.stall_timeout:g}"])
    cfg = BedConfig(prefill=2, decode=2, rate="1gbit", store_size=512 << 20,
                    decode_segment_size=256 << 20, ready_timeout_s=400,
                    log_dir=tempfile.mkdtemp(prefix="drain-bench-"))
    echo(f"starting the cluster (logs: {cfg.log_dir})")
    res: dict[str, Any] = {"logs": cfg.log_dir}
    with Testbed() as bed:
        c = DrainCluster(bed, cfg, worker_extra, conductor_extra, echo=lambda _m: None)
        with c:
            res.update(measure(Bench(c, plan, echo), set(args.rows), feats))
    return res


def measure(b: Bench, rows: set[int], feats: dict[str, bool]) -> dict[str, Any]:
    """The parts the rows need, each leaving the cluster whole for the next (the failover
    part, which kills a decode, comes last)."""
    res: dict[str, Any] = {}
    b.wait_routed()
    if rows & {1, 2, 3}:
        res["drain"] = attempt(drain_part, b, feats)
    if 4 in rows:
        for kind in ("sigstop", "partition"):
            res[kind] = attempt(hung_part, b, kind)
    if 5 in rows:
        res["restart"] = attempt(restart_part, b)
    if rows & {2, 3}:
        b.echo("  [kill] the failover path")
        res["failover"] = attempt(failover_part, b)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5", help="the table's rows to measure (1-5)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer, shorter streams and faults (under 3 min): a dry run")
    ap.add_argument("--stall-timeout", type=float, default=None,
                    help="--stream-stall-timeout for the Conductor (default: its own)")
    ap.add_argument("--out", default=None, help="output path without extension")
    args = ap.parse_args()
    given = args.rows
    try:
        args.rows = sorted({int(x) for x in given.split(",") if x.strip()})
    except ValueError:
        args.rows = []
    if not args.rows or any(r not in range(1, 6) for r in args.rows):
        ap.error(f"--rows: give numbers from 1 to 5, such as 1,2,3 (not {given!r})")
    # SIGTERM ends the run through the `with` blocks: the bed's processes and namespaces go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    plan = QUICK if args.quick else FULL
    out = args.out or str(BENCH_DIR / "results" / ("drain_bench-quick" if args.quick
                                                   else "drain_bench"))
    feats = features()
    if args.stall_timeout is not None and not feats["stream_stall_timeout"]:
        ap.error("--stall-timeout: this Conductor has no --stream-stall-timeout flag yet")
    print(f"features: {feats}")
    t0 = time.monotonic()
    res: dict[str, Any] = {
        "bench": "drain_bench", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
                   f"kernel {platform.release()}",
        "commit": commit(), "plan": asdict(plan), "quick": args.quick, "rows": args.rows,
        "features": feats,
        "stall_timeout": args.stall_timeout}
    res.update(run(args, plan, feats, print))
    res["wall_s"] = time.monotonic() - t0
    text = render(table(res, plan))
    print(text)
    Path(out + ".json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    feat = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in feats.items())
    Path(out + ".txt").write_text(f"{res['machine']}, {res['date']}, tree {res['commit']}, "
                                  f"{res['wall_s']:.0f} s"
                                  f"{' (--quick)' if args.quick else ''}\nfeatures: {feat}\n\n"
                                  f"{text}\n")
    print(f"wrote {out}.json and .txt ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
