"""The drain benchmark's plan, per-stream results and table (`drain_bench.py` measures).

A stream's *stall* after a fault at time t is the largest gap between two of its consecutive
tokens where the later came after t; *flow again* is that later token's arrival minus t. A
stream is *moved* when it was on the decode that was hit and its last token came after the
pivot (the drained or killed decode's exit; the fault itself for a freeze or partition).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.drain_streams import Stream
from bench.multihost_bench import _met

BLOCK_TOKENS = 64
NM = "not measured: "


@dataclass(frozen=True)
class Plan:
    streams: int
    tokens: int
    grace_s: float
    fault_s: float
    """How long a decode stays frozen (SIGSTOP) or partitioned."""
    prompt_words: int
    restart_tokens: int
    restart_prompts: int
    client_timeout_s: float


FULL = Plan(streams=20, tokens=200, grace_s=5.0, fault_s=20.0, prompt_words=120,
            restart_tokens=2000, restart_prompts=3, client_timeout_s=120.0)
QUICK = Plan(streams=4, tokens=80, grace_s=1.0, fault_s=4.0, prompt_words=60,
             restart_tokens=500, restart_prompts=1, client_timeout_s=60.0)
"""A dry run: the faults still outlast the Conductor's default stall deadline (2 s)."""


IN_FLIGHT_S = 0.5
"""A token the decode had sent when it froze or was cut off arrives within this."""


def describe(st: Stream, victim: str, t_sig: float, pivot: float,
             tokens: int) -> dict[str, Any]:
    stall = st.stall_after(t_sig, max(t_sig + IN_FLIGHT_S, pivot))
    on = st.decode == victim
    d: dict[str, Any] = {
        "index": st.index, "decode": st.decode, "prefill": st.prefill, "error": st.error,
        "tokens": len(st.pieces), "complete": st.complete(tokens), "on_victim": on,
        "moved": on and bool(st.arrivals) and st.arrivals[-1] > pivot,
        "stall_s": stall[0] if stall else None, "flow_again_s": stall[1] if stall else None,
        "extra_tokens": max(0, len(st.pieces) - tokens),
        "text": "".join(st.pieces), "pieces": st.pieces}
    return d


def summary(run: dict[str, Any], tokens: int) -> dict[str, Any]:
    ss = run["streams"]
    moved = [s for s in ss if s["moved"]]
    stalls = [s["stall_s"] for s in moved if s["stall_s"] is not None]
    flows = [s["flow_again_s"] for s in moved if s["flow_again_s"] is not None]
    out: dict[str, Any] = {"on_victim": sum(s["on_victim"] for s in ss), "moved": len(moved),
           "broken": sum(not s["complete"] for s in ss),
           "broken_on_victim": sum(not s["complete"] for s in ss if s["on_victim"]),
           "extra_tokens": sum(s["extra_tokens"] for s in ss),
           "stall_p50_s": statistics.median(stalls) if stalls else None,
           "stall_max_s": max(stalls) if stalls else None,
           "flow_p50_s": statistics.median(flows) if flows else None,
           "flow_max_s": max(flows) if flows else None,
           "recomputed_per_moved": run["prefill_computed"] / len(moved) if moved else None}
    cond = run["metric_deltas"].get("conductor", {})
    out["conductor_handoffs"] = {k: v for k, v in cond.items()
                                 if k.startswith("mooncake_conductor_handoffs_total")}
    out["conductor_resumes_ok"] = cond.get('mooncake_conductor_resumes_total{outcome="ok"}', 0)
    for hist in ("handoff_stall_seconds", "resume_seconds"):  # the Conductor's own view
        n = cond.get(f"mooncake_conductor_{hist}_count", 0)
        seconds = cond.get(f"mooncake_conductor_{hist}_sum", 0.0)
        out[f"conductor_{hist}_mean"] = seconds / n if n else None
    return out


def _count(series: dict[str, float]) -> str:
    """A counter's total over its labels, with each label's share ("-" when none exists)."""
    if not series:
        return "-"
    parts = ", ".join(f"{k[k.find('{'):]} {v:.0f}" for k, v in series.items())
    return f"{sum(series.values()):.0f} ({parts})"


def fmt_s(v: float | None) -> str:
    return f"{v:.2f}s" if v is not None else "-"


# -- the table ---------------------------------------------------------------------------------


def _why(part: dict[str, Any] | None) -> str | None:
    if part is None:
        return "not run"
    if "not_measured" in part:
        return str(part["not_measured"])
    if "error" in part:
        return f"the run failed ({part['error'][:140]})"
    return None


def row_broken(res: dict[str, Any], p: Plan) -> list[str]:
    name = (f"{p.streams} streams of {p.tokens} tokens on a decode told to stop "
            f"(SIGTERM, {p.grace_s:g} s grace): broken streams")
    d = res.get("drain")
    why = _why(d)
    if why or d is None:
        return [name, "0", NM + (why or ""), "-"]
    ok = d["broken"] == 0 and d["text_equal"] == p.streams and d["extra_tokens"] == 0
    eq = (f"text equal {d['text_equal']}/{p.streams}, tokens equal {d['tokens_equal']}/"
          f"{p.streams}" if d["text_equal"] is not None
          else f"text not compared: {d.get('reference_error', '')[:80]}")
    return [name, "0; text = undisturbed; no token twice",
            f"{d['broken']} ({d['moved']} handed over, {d['on_victim'] - d['moved']} finished "
            f"there; Conductor handoffs {_count(d['conductor_handoffs'])}, "
            f"{d['conductor_resumes_ok']:.0f} failover resumes; {eq}, tokens twice "
            f"{d['extra_tokens']})", _met(ok)]


def row_stall(res: dict[str, Any]) -> list[str]:
    name = "their stall at the handoff p50 / max (failover: kill -9, same workload)"
    target = "report; p50 <= failover's / 2"
    d, f = res.get("drain"), res.get("failover")
    fo = (f"failover {fmt_s(f['stall_p50_s'])} / {fmt_s(f['stall_max_s'])}"
          if f and not _why(f) else f"failover {NM}{_why(f)}")
    why = _why(d)
    if why or d is None:
        return [name, target, f"{NM}{why}; {fo}", "-"]
    if not d["moved"]:
        return [name, target, f"{NM}no stream was handed over; {fo}", "-"]
    met = "-"
    if f and not _why(f) and f["stall_p50_s"] is not None:
        met = _met(d["stall_p50_s"] <= f["stall_p50_s"] / 2)
    return [name, target, f"{fmt_s(d['stall_p50_s'])} / {fmt_s(d['stall_max_s'])}; {fo}", met]


def row_recompute(res: dict[str, Any]) -> list[str]:
    name = "tokens recomputed per handed-over stream (prefill hosts' computed tokens)"
    target = f"<= {BLOCK_TOKENS} (one block)"
    d, f = res.get("drain"), res.get("failover")
    fo = (f"failover {f['recomputed_per_moved']:.0f}"
          if f and not _why(f) and f["recomputed_per_moved"] is not None else "failover -")
    why = _why(d)
    if why or d is None:
        return [name, target, f"{NM}{why}; {fo}", "-"]
    if d["recomputed_per_moved"] is None:
        return [name, target, f"{NM}no stream was handed over; {fo}", "-"]
    x = d["recomputed_per_moved"]
    return [name, target, f"{x:.0f}; {fo}", _met(x <= BLOCK_TOKENS)]


def row_hung(res: dict[str, Any], kind: str, p: Plan) -> list[str]:
    what = "frozen (SIGSTOP)" if kind == "sigstop" else "partitioned (link down)"
    name = f"a decode {what} {p.fault_s:g} s mid-stream: time until its streams flow again"
    d = res.get(kind)
    why = _why(d)
    if why or d is None:
        return [name, "<= 5 s, 0 broken", NM + (why or ""), "-"]
    if not d["moved"]:
        return [name, "<= 5 s, 0 broken", f"{NM}no stream was on it unfinished", "-"]
    ok = d["flow_max_s"] is not None and d["flow_max_s"] <= 5.0 and d["broken"] == 0
    return [name, "<= 5 s, 0 broken",
            f"max {fmt_s(d['flow_max_s'])} (p50 {fmt_s(d['flow_p50_s'])}) over {d['moved']} "
            f"streams; {d['broken']} broken", _met(ok)]


def row_restart(res: dict[str, Any]) -> list[str]:
    name = "first repeat after a Conductor restart (kill -9): routed to the holder, cached"
    d = res.get("restart")
    why = _why(d)
    if why or d is None:
        return [name, "yes, >= 90%", NM + (why or ""), "-"]
    f = d["first"]
    ok = f["routed_to_holder"] and f["cached_share"] >= 0.9
    return [name, "yes, >= 90%",
            f"{'yes' if f['routed_to_holder'] else 'no'} ({f['prefill']}, holder "
            f"{f['holder']}), cached {f['cached_tokens']}/{f['prompt_tokens']} = "
            f"{f['cached_share']:.0%}", _met(ok)]


def table(res: dict[str, Any], p: Plan) -> list[list[str]]:
    rows = [["measure", "target", "value", "met"]]
    sel = set(res["rows"])
    if 1 in sel:
        rows.append(row_broken(res, p))
    if 2 in sel:
        rows.append(row_stall(res))
    if 3 in sel:
        rows.append(row_recompute(res))
    if 4 in sel:
        rows += [row_hung(res, "sigstop", p), row_hung(res, "partition", p)]
    if 5 in sel:
        rows.append(row_restart(res))
    return rows
