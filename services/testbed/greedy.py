"""Greedy token ids straight from a prefill target, run as a process on a bed host.

The OpenAI API returns text, not token ids; a prefill group must give the very ids a single
instance gives. This asks prefill targets (a single instance or a group's leader) over the
serving gRPC contract for the greedy continuation of a chat prompt, one `Prefill` call per token
(prompt + the ids so far, prefix cache on: each call computes only the new tail), and writes
`{"prompt_ids": [...], "ids": [...], "cached": [...], "stages": [...]}` per job, as a JSON list.

It runs as its own process on a host (`greedy_ids`), because gRPC's I/O threads would not
follow `Host.call`'s namespace switch. The cluster token comes from MOONCAKE_CLUSTER_TOKEN.

    python -m mooncake_k8s.testbed.greedy --jobs jobs.json --out results.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mooncake_k8s.testbed.bed import Host


@functools.cache
def _tokenizer() -> Any:
    from mooncake_k8s.engine.loading import ensure_builtin, load_tokenizer

    # the built-in model's tokenizer, as the Conductor loads it (`conductor.service`)
    return load_tokenizer(ensure_builtin(progress=False)[0])


def chat_ids(text: str) -> list[int]:
    """The prompt's token ids as the Conductor makes them (the chat template, one user turn)."""
    out = _tokenizer().apply_chat_template([{"role": "user", "content": text}],
                                  add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def stage_dicts(resp: Any) -> list[dict[str, Any]]:
    """PrefillResponse.stages as plain dicts (empty for a single instance)."""
    return [{"stage": s.stage, "layers": [s.layer_lo, s.layer_hi], "busy_s": s.busy_s,
             "idle_s": s.idle_s, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
             "kv_bytes": s.kv_bytes} for s in resp.stages]


@dataclass
class Job:
    """One greedy continuation to ask for: `text` (a user turn) from prefill `target`,
    `tokens` tokens, block keys salted with `tenant` (another tenant's blocks are not reused)."""

    target: str
    text: str
    tokens: int = 4
    tenant: str = ""


def run(job: Job, timeout_s: float) -> dict[str, Any]:
    import grpc

    from mooncake_k8s.common.auth import call_metadata
    from mooncake_k8s.common.rpc import serving_pb2 as pb
    from mooncake_k8s.common.serving_rpc import stub

    prompt = chat_ids(job.text)
    meta = call_metadata(os.environ.get("MOONCAKE_CLUSTER_TOKEN", ""))
    ids: list[int] = []
    cached: list[int] = []
    stages: list[list[dict[str, Any]]] = []
    with grpc.insecure_channel(job.target) as ch:
        prefill = stub("prefill", ch)
        for _ in range(job.tokens):
            req = pb.PrefillRequest(request_id=f"greedy-{uuid.uuid4().hex[:12]}",
                                    token_ids=prompt + ids, use_prefix_cache=True,
                                    tenant=job.tenant,
                                    sampling=pb.Sampling(temperature=0.0, max_tokens=1),
                                    plan=pb.KVPlan(planned=False))
            resp = prefill.Prefill(req, metadata=meta, timeout=timeout_s)
            ids.append(int(resp.first_token))
            cached.append(int(resp.cached_tokens))
            stages.append(stage_dicts(resp))
    return {"prompt_ids": prompt, "ids": ids, "cached": cached, "stages": stages}


def greedy_ids(host: Host, jobs: Sequence[Job], env: dict[str, str], log: Path,
               timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """`run` of every job, in order, in one process on `host` (its network; one process for
    all: starting one costs seconds). Each result: `prompt_ids`, `ids` (the greedy tokens),
    `cached` (per call: prompt tokens reused) and `stages` (per call: PrefillResponse.stages)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([asdict(j) for j in jobs], f)
    out = Path(f.name).with_suffix(".out.json")
    try:
        p = host.spawn([sys.executable, "-m", "mooncake_k8s.testbed.greedy", "--jobs", f.name,
                        "--out", str(out), "--timeout", str(timeout_s)], env=env, log=log)
        calls = sum(j.tokens for j in jobs)
        rc = p.wait(timeout=timeout_s * calls + 120)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"greedy ids failed ({rc}); see {log}")
        result: list[dict[str, Any]] = json.loads(out.read_text())
        return result
    finally:
        Path(f.name).unlink(missing_ok=True)
        out.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", required=True, help="JSON list of {target, text, tokens, tenant}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per Prefill call")
    ap.add_argument("--out", required=True, help="where the JSON list of results goes")
    a = ap.parse_args()
    jobs = [Job(**j) for j in json.loads(Path(a.jobs).read_text())]
    Path(a.out).write_text(json.dumps([run(j, a.timeout) for j in jobs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
