"""The drain benchmark's clients and what it reads from a cluster (`drain_bench.py` runs them).

Streams are plain HTTP/SSE clients of the Conductor's `/v1/completions` (temperature 0,
`ignore_eos`, usage included), each run on the Conductor's host through `BedCluster.client_call`
from a thread of its own. The API sends one SSE chunk per token (an empty text included), so a
stream's chunk list is its token list: a token streamed twice shows as an extra chunk, and the
chunks' arrival times give the stalls.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from mooncake_k8s.testbed.cluster import BedCluster

MODEL = "SmolLM2-135M-Instruct"
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "glacier", "harbor", "island",
         "jungle", "kelp", "lagoon", "meadow", "nebula", "oasis", "prairie"]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def stream_prompt(tag: str, seed: int, n_words: int) -> str:
    """A completion prompt of about 1.3 tokens per word; `tag` and `seed` make it unique."""
    return f"Note {tag}-{seed}: " + " ".join(
        WORDS[(i * 5 + seed * 7 + i // 3) % len(WORDS)] for i in range(n_words))


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    index: int
    prompt: str
    decode: str = ""
    prefill: str = ""
    pieces: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    finished: bool = False

    def complete(self, tokens: int) -> bool:
        """Every token arrived, once, and the stream ended cleanly."""
        return (self.finished and not self.error and len(self.pieces) == tokens
                and self.usage.get("completion_tokens") == tokens)

    def stall_after(self, t: float, until: float) -> tuple[float, float] | None:
        """(largest gap between two consecutive tokens where the later came after `t` and the
        earlier by `until`, the later one's arrival - t): the stall a fault at `t` caused, and
        when the stream flowed again. `until` is when the faulty decode's last token can have
        left (its exit; the fault itself for a freeze): a gap that opens later is the new
        decode's, not the fault's. None if no token came after `t`."""
        best: tuple[float, float] | None = None
        prev = t
        for a in self.arrivals:
            if a > t and prev <= until and (best is None or a - prev > best[0]):
                best = (a - prev, a - t)
            prev = a
        return best


def run_stream(url: str, st: Stream, max_tokens: int, timeout: float) -> None:
    """Fill `st` from one streamed completion (run on the Conductor's host)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": st.prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        st.decode = resp.getheader("X-Mooncake-Decode", "")
        st.prefill = resp.getheader("X-Mooncake-Prefill", "")
        if resp.status != 200:
            st.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                st.finished = True
                break
            if not line.startswith("data:"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                st.error = json.dumps(chunk["error"])[:300]
            if chunk.get("usage"):
                st.usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                st.pieces.append(ch.get("text", ""))
                st.arrivals.append(time.monotonic())
    except (OSError, http.client.HTTPException, ValueError) as e:
        st.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


class Workload:
    """N concurrent streams against the cluster's Conductor."""

    def __init__(self, c: BedCluster, prompts: list[str], max_tokens: int,
                 timeout: float) -> None:
        self.c, self.max_tokens, self.timeout = c, max_tokens, timeout
        self.streams = [Stream(i, p) for i, p in enumerate(prompts)]
        self.threads = [threading.Thread(target=self._one, args=(s,), daemon=True)
                        for s in self.streams]

    def _one(self, st: Stream) -> None:
        try:
            self.c.client_call(run_stream, self.c.base_url, st, self.max_tokens, self.timeout)
        except Exception as e:  # the bed's namespace switch failed: a broken stream too
            st.error = st.error or f"{type(e).__name__}: {e}"

    def start(self) -> Workload:
        for t in self.threads:
            t.start()
        return self

    def done(self, st: Stream) -> bool:
        return st.finished or bool(st.error)

    def wait_tokens(self, n: int, streams: list[Stream] | None = None,
                    timeout: float = 600.0) -> None:
        """Until each stream (of `streams`) has `n` tokens or has ended."""
        deadline = time.monotonic() + timeout
        for st in streams if streams is not None else self.streams:
            while len(st.pieces) < n and not self.done(st):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stream {st.index} has {len(st.pieces)} tokens, "
                                       f"waited for {n}")
                time.sleep(0.02)

    def join(self) -> None:
        for t in self.threads:
            t.join(self.timeout * 2 + 60)


# -- metrics ----------------------------------------------------------------------------------


def _get(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as r:
        return str(r.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = float(m.group(2))
    return out


def scrape(c: BedCluster, name: str) -> dict[str, float]:
    """A component's metrics, read from its own host ({} when it does not answer)."""
    url = (f"{c.base_url}/metrics" if name == "conductor" else c.metrics_url(name))
    try:
        return parse_metrics(c.hosts[name].call(_get, url))
    except OSError:
        return {}


def total(samples: dict[str, float], name: str, labels: str = "") -> float:
    """Sum of `name`'s samples whose labels contain `labels`."""
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and labels in k)


INTERESTING = re.compile(r"handoff|recomput|resume|stall|reroute|drain")
"""Series whose deltas a disturbed run records (whatever the other areas named them)."""


def deltas(before: dict[str, dict[str, float]],
           after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per component, the change of every INTERESTING series (histogram buckets and the
    counters' creation times left out)."""
    out: dict[str, dict[str, float]] = {}
    for comp, now in after.items():
        was = before.get(comp, {})
        d = {k: v - was.get(k, 0.0) for k, v in now.items()
             if INTERESTING.search(k) and "_bucket{" not in k and "_created" not in k
             and v != was.get(k, 0.0)}
        if d:
            out[comp] = d
    return out
