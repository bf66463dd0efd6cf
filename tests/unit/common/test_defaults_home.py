"""Defaults live in one module (common/defaults.py): no other product module re-types them.

Ports are the values a copy would silently drift from (the operator's Services against the
CLI's listeners), so every number that is one of our default ports counts as a copy wherever
it appears as a literal outside defaults.py, docstrings and comments aside.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mooncake_k8s.common import defaults as d

REPO = Path(__file__).resolve().parents[3]
PORTS = {d.CONDUCTOR_PORT, d.MASTER_PORT, d.MASTER_FAST_PORT, d.NODE_TRANSFER_PORT,
         d.PREFILL_PORT, d.DECODE_PORT, d.WORKER_METRICS_PORT, d.MASTER_METRICS_PORT,
         d.NODE_METRICS_PORT}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    out.add(id(stmt.value))
    return out


def copies(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in skip:
            continue
        v = node.value
        if (isinstance(v, int) and not isinstance(v, bool) and v in PORTS) or (
                isinstance(v, str) and any(f":{p}" in v for p in PORTS)):
            found.append(f"{path}:{node.lineno}: {v!r}")
    return found


def test_no_product_module_retypes_a_default_port() -> None:
    files = [p for root in ("services", "operator") for p in (REPO / root).rglob("*.py")
             if "rpc" not in p.parts and "cpu_path" not in p.parts
             and p.name not in ("defaults.py", "testing.py")]
    assert len(files) > 100
    assert [c for p in files for c in copies(p)] == []


def test_the_checker_finds_a_copy(tmp_path: Path) -> None:
    f = tmp_path / "probe.py"
    f.write_text('"""Doc with :50051 is fine."""\nPORT = 50051\nADDR = "h:9090"\nN = 7\n')
    assert [c.split(": ", 1)[1] for c in copies(f)] == ["50051", "'h:9090'"]
