"""The import contract of `services/` (docs/architecture.md, layout): checked on every module's
direct imports, so a new reach into another component's internals fails here.

- nothing outside tests imports a `testing` module (the harnesses ship in the package for
  tests, benchmarks and `mooncake store demo`, which shows the harness at work; never for the
  product's own processes);
- no component imports another component's *server* (the store master and its state, the
  storage node, the sidecar server, the Conductor's HTTP front and serving path, the prefill
  and decode services); only the entry points (`cli*`, `up`) start servers. What still breaks
  the rule is listed in KNOWN with its reason, so the debt stays visible and cannot grow;
- the Conductor is layered by the request's direction of travel: `conductor.sched` is pure
  (only `common` and itself of ours; no gRPC, aiohttp, metrics or store client), `serving`
  never imports `http`, and `conductor.tools` (calibrate, analyze, the simulator) is imported
  by no server module.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"
ENTRY_POINTS = {"cli", "up", "supervise"}
"""Top-level modules and packages that start servers (the `mooncake` CLI and `mooncake up`)."""
TOOLS = {"testing", "demo"}
"""Modules that may use the test harnesses."""
SERVERS = {
    "store": {"master", "node"},
    "sidecar": {"server"},
    "conductor": {"http", "serving", "service"},
    "prefill": {"service"},
    "decode": {"service"},
}
KNOWN: set[tuple[str, str]] = set()
"""Violations still to fix, each with its reason (none now: the decode worker's local segment
goes through the store's public embedding API, `store.local`)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVICES).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("mooncake_k8s", *parts))


def imports(path: Path, ours_only: bool = True) -> set[str]:
    """Absolute names of every `mooncake_k8s` module `path` imports (relative ones resolved);
    with `ours_only=False`, every module it imports."""
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("mooncake_k8s.") or not ours_only}


def modules() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in SERVICES.rglob("*.py")
            if "rpc" not in p.parts and "cpu_path" not in p.parts}


def test_no_product_module_imports_a_testing_module() -> None:
    bad = sorted((m, dep) for m, deps in modules().items() for dep in deps
                 if dep.split(".")[-1] == "testing" and m.split(".")[-1] not in TOOLS)
    assert bad == []


def test_no_component_imports_another_components_server() -> None:
    graph = modules()
    assert len(graph) > 100
    bad = set()
    for mod, deps in graph.items():
        parts = mod.split(".")
        if len(parts) == 1 or parts[1] in ENTRY_POINTS:
            continue
        for dep in deps:
            d = dep.split(".")
            if len(d) >= 3 and d[1] != parts[1] and d[2] in SERVERS.get(d[1], set()):
                bad.add((mod, dep))
    assert sorted(bad - KNOWN) == [], "a component reaches into another's server"
    assert sorted(KNOWN - bad) == [], "KNOWN lists a violation that is gone: remove it"


def test_the_checker_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    graph = modules()
    assert "mooncake_k8s.store.local" in graph["mooncake_k8s.decode.service"]
    assert "mooncake_k8s.transfer.ops" in graph["mooncake_k8s.transfer.shm"]  # `from .ops`


SCHED = "mooncake_k8s.conductor.sched"
IO_LIBRARIES = {"grpc", "aiohttp", "prometheus_client", "socket", "asyncio", "threading",
                "urllib", "http", "redis"}


def test_the_scheduler_core_is_pure() -> None:
    files = [p for p in SERVICES.rglob("*.py") if module_name(p).startswith(SCHED)]
    assert len(files) >= 5
    bad = {}
    for p in files:
        deps = imports(p, ours_only=False)
        wrong = sorted(d for d in deps if (d.startswith("mooncake_k8s.")
                                           and not d.startswith(("mooncake_k8s.common",
                                                                 SCHED)))
                       or d.split(".")[0] in IO_LIBRARIES)
        if wrong:
            bad[module_name(p)] = wrong
    assert bad == {}


def test_the_conductor_is_layered_by_the_direction_of_travel() -> None:
    graph = modules()
    bad = set()
    for mod, deps in graph.items():
        for dep in deps:
            if (mod.startswith("mooncake_k8s.conductor.serving")
                    and dep.startswith("mooncake_k8s.conductor.http")):
                bad.add((mod, dep))
            if (dep.startswith("mooncake_k8s.conductor.tools")
                    and not mod.startswith("mooncake_k8s.conductor.tools")
                    and mod.partition(".")[2].split(".")[0] not in ENTRY_POINTS):
                bad.add((mod, dep))
    assert sorted(bad) == []
