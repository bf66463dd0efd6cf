"""Greedy token ids straight from a prefill target, run as a process on a bed host.

The OpenAI API returns text, not token ids; a prefill group must give the very ids a single
instance gives. This asks one prefill target (a single instance or a group's leader) over the
serving gRPC contract for the greedy continuation of a chat prompt, one `Prefill` call per token
(prompt + the ids so far, prefix cache on: each call computes only the new tail), and prints
`{"prompt_ids": [...], "ids": [...], "cached": [...], "stages": [...]}` as one JSON line.

It runs as its own process on a host (`greedy_ids`), because gRPC's I/O threads would not
follow `Host.call`'s namespace switch. The cluster token comes from MOONCAKE_CLUSTER_TOKEN.

    python -m mooncake_k8s.testbed.greedy --target 10.77.0.5:20001 --text-file p.txt --tokens 4
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from mooncake_k8s.testbed.bed import Host


@functools.cache
def _tokenizer() -> Any:
    from mooncake_k8s.conductor.service import load_tokenizer
    from mooncake_k8s.engine import EngineConfig

    return load_tokenizer(EngineConfig())


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


def run(target: str, text: str, tokens: int, timeout_s: float,
        tenant: str = "") -> dict[str, Any]:
    import grpc

    from mooncake_k8s.common.auth import call_metadata
    from mooncake_k8s.common.rpc import serving_pb2 as pb
    from mooncake_k8s.common.serving_rpc import stub

    prompt = chat_ids(text)
    meta = call_metadata(os.environ.get("MOONCAKE_CLUSTER_TOKEN", ""))
    ids: list[int] = []
    cached: list[int] = []
    stages: list[list[dict[str, Any]]] = []
    with grpc.insecure_channel(target) as ch:
        prefill = stub("prefill", ch)
        for _ in range(tokens):
            req = pb.PrefillRequest(request_id=f"greedy-{uuid.uuid4().hex[:12]}",
                                    token_ids=prompt + ids, use_prefix_cache=True,
                                    tenant=tenant,
                                    sampling=pb.Sampling(temperature=0.0, max_tokens=1),
                                    plan=pb.KVPlan(planned=False))
            resp = prefill.Prefill(req, metadata=meta, timeout=timeout_s)
            ids.append(int(resp.first_token))
            cached.append(int(resp.cached_tokens))
            stages.append(stage_dicts(resp))
    return {"prompt_ids": prompt, "ids": ids, "cached": cached, "stages": stages}


def greedy_ids(host: Host, target: str, text: str, tokens: int, env: dict[str, str],
               log: Path, timeout_s: float = 300.0, tenant: str = "") -> dict[str, Any]:
    """`run` as a process on `host` (its network): the greedy ids `target` gives for `text`
    (`tenant` salts the block keys: another tenant's cached blocks are not reused)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    out = Path(f.name).with_suffix(".json")
    try:
        p = host.spawn([sys.executable, "-m", "mooncake_k8s.testbed.greedy", "--target", target,
                        "--text-file", f.name, "--tokens", str(tokens), "--out", str(out),
                        "--timeout", str(timeout_s), "--tenant", tenant], env=env, log=log)
        rc = p.wait(timeout=timeout_s * tokens + 120)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"greedy ids from {target} failed ({rc}); see {log}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        Path(f.name).unlink(missing_ok=True)
        out.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="host:port of a prefill target")
    ap.add_argument("--text-file", required=True)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per Prefill call")
    ap.add_argument("--tenant", default="", help="salts the block keys (PrefillRequest.tenant)")
    ap.add_argument("--out", required=True, help="where the JSON result goes")
    a = ap.parse_args()
    res = run(a.target, Path(a.text_file).read_text(), a.tokens, a.timeout, a.tenant)
    Path(a.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
