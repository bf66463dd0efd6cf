"""`common` stays at the bottom: it imports no engine, store, worker or service (DESIGN §2)."""

from __future__ import annotations

import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parents[2] / "services" / "common"


def _ours(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against mooncake_k8s.common
                parts = ["mooncake_k8s", "common"][: 2 - (node.level - 1)]
                found.add(".".join([*parts, node.module]))
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("mooncake_k8s.")}


def test_common_imports_only_common() -> None:
    files = [p for p in COMMON.rglob("*.py") if "rpc" not in p.parts]
    assert files
    bad = {str(p.relative_to(COMMON)): sorted(m for m in _ours(p)
                                              if not m.startswith("mooncake_k8s.common"))
           for p in files}
    assert {k: v for k, v in bad.items() if v} == {}
