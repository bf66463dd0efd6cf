"""The import contract of `mooncake_k8s` as data: `[tool.importlinter]` in pyproject.toml,
checked here by import-linter (docs/architecture.md, "Layers", draws it).

The contracts say, on every module's imports:

- the layers: cli (with the operator beside it) > up > supervise > conductor > prefill | decode
  > worker > engine > sidecar > store > transfer > common; each imports only what is below it,
  prefill and decode not each other, and every top-level module has a layer;
- the operator imports only `common` of ours; only the command line imports it;
- the store's master knows neither its client nor its storage node (they meet on the wire);
- no component imports another component's *server* (the store master and node, the sidecar
  server, the Conductor's HTTP front, serving path and service, the prefill and decode
  services): only the entry points (`cli`, `up`, `supervise`) start servers;
- the Conductor is layered by the request's direction of travel: `conductor.sched` is pure
  (only `common` and itself of ours; no gRPC, aiohttp, metrics, sockets, threads, event loop,
  Redis or store client), `serving` never imports `http`, and `conductor.tools` (calibrate,
  analyze, the simulator) is imported by no server module;
- nothing outside tests imports a `testing` module (the harnesses ship in the package for
  tests and benchmarks, never for the product's own processes).

grimp cannot follow the editable install (`mooncake_k8s` is mapped from services/ and
operator/), so the check runs on a view: a folder `mooncake_k8s` of links to both, as
scripts/typecheck.sh builds for mypy. `python tests/unit/test_import_contract.py` prints
import-linter's own report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services"
CONFIG = REPO / "pyproject.toml"
ENTRY_POINTS = {"cli", "up", "supervise"}
"""Top-level modules and packages that start servers (the `mooncake` CLI and `mooncake up`)."""


def build_view(root: Path) -> Path:
    """`root/mooncake_k8s`: links to every entry of services/ and to operator/. Returns root,
    the folder to put on PYTHONPATH."""
    view = root / "mooncake_k8s"
    view.mkdir(parents=True)
    for entry in sorted(SERVICES.iterdir()):
        if entry.name == "__pycache__" or entry.name.endswith(".egg-info"):
            continue
        (view / entry.name).symlink_to(entry)
    (view / "operator").symlink_to(REPO / "operator")
    return root


def add_module(root: Path, relpath: str, text: str) -> None:
    """Write `mooncake_k8s/<relpath>` into a view without touching the tree: each linked
    folder on the way becomes a real folder of links first."""
    here = root / "mooncake_k8s"
    for part in Path(relpath).parts[:-1]:
        here = here / part
        if here.is_symlink():
            target = here.resolve()
            here.unlink()
            here.mkdir()
            for entry in target.iterdir():
                if entry.name != "__pycache__":
                    (here / entry.name).symlink_to(entry)
    (here / Path(relpath).name).write_text(text)


def _env(root: Path) -> dict[str, str]:
    # PYTHONSAFEPATH: the repository's operator/ must not shadow the stdlib's `operator`.
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1", "COLUMNS": "400"}


def lint_imports(root: Path) -> tuple[int, dict[str, str], str]:
    """Run `lint-imports` on the view at `root`: (exit code, {contract name: KEPT|BROKEN},
    the whole report)."""
    proc = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--config", str(CONFIG), "--no-cache"],
        cwd=REPO, env=_env(root), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    found = dict((m.group(1), m.group(2))
                 for m in re.finditer(r"^(.+) (KEPT|BROKEN)$", out, re.MULTILINE))
    return proc.returncode, found, out


def contracts() -> list[dict[str, Any]]:
    with CONFIG.open("rb") as f:
        got: list[dict[str, Any]] = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return got


def contract(cid: str) -> dict[str, Any]:
    return next(c for c in contracts() if c["id"] == cid)


@pytest.fixture(scope="module")
def view(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_view(tmp_path_factory.mktemp("view"))


def test_the_import_contract_holds(view: Path) -> None:
    code, found, out = lint_imports(view)
    assert len(found) == len(contracts()) >= 10, out
    assert {n for n, state in found.items() if state != "KEPT"} == set(), out
    assert code == 0, out


def test_the_checker_sees_the_whole_package_and_every_import_form(view: Path) -> None:
    """The view holds services/ and operator/, and grimp sees imports across components,
    within a package and inside functions (the CLI's lazy ones); relative imports (banned by
    ruff's TID252, still resolved) are probed below."""
    probe = (
        "import grimp, json\n"
        "g = grimp.build_graph('mooncake_k8s', cache_dir=None)\n"
        "e = lambda a, b: g.direct_import_exists(importer='mooncake_k8s.' + a,"
        " imported='mooncake_k8s.' + b)\n"
        "print(json.dumps({'modules': len(g.modules),"
        " 'operator': len([m for m in g.modules if m.startswith('mooncake_k8s.operator.')]),"
        " 'sched': len([m for m in g.modules if m.startswith('mooncake_k8s.conductor.sched.')]),"
        " 'absolute': e('worker.base', 'store.local'),"
        " 'sibling': e('transfer.shm', 'transfer.ops'),"
        " 'lazy': e('cli.main', 'store.demo')}))\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(view), capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["modules"] > 150 and got["operator"] > 10 and got["sched"] >= 5
    assert got["absolute"] and got["sibling"] and got["lazy"]


def test_the_contracts_catch_what_they_forbid(tmp_path: Path) -> None:
    """Each contract breaks on a module that does what it forbids (so none can pass vacuously,
    e.g. by a pattern that matches no module)."""
    root = build_view(tmp_path)
    add_module(root, "transfer/_probe.py",
               "from ..store import testing  # relative\n"
               "import mooncake_k8s.conductor.service  # absolute\n")
    add_module(root, "conductor/sched/_probe.py",
               "import grpc\nfrom mooncake_k8s.store import local\n")
    add_module(root, "conductor/serving/_probe.py",
               "def lazy():\n    from mooncake_k8s.conductor.http import api\n")
    add_module(root, "worker/_probe.py", "from mooncake_k8s.conductor.tools import calibrate\n")
    add_module(root, "operator/_probe.py", "from mooncake_k8s.store import local\n")
    add_module(root, "decode/_probe.py", "from mooncake_k8s.prefill import service\n")
    add_module(root, "store/node/_probe.py", "from mooncake_k8s.store.master import state\n")
    add_module(root, "store/master/_probe.py", "from mooncake_k8s.store.client import client\n")
    add_module(root, "newpart.py", "")
    code, found, out = lint_imports(root)
    assert code != 0
    broken = {c["id"] for c in contracts() if found.get(str(c["name"])) == "BROKEN"}
    assert broken == {c["id"] for c in contracts()}, out
    assert "mooncake_k8s.newpart" in out  # exhaustive: a new top-level module needs a layer


def test_the_forbidden_lists_name_every_part() -> None:
    """`sched` may import only common and itself of ours, the operator only common: their
    forbidden lists name every other part, so a part added to the layers is covered too."""
    layers: list[str] = contract("layers")["layers"]
    parts = {p.strip() for layer in layers for p in re.split(r"[|:]", layer)}
    assert ENTRY_POINTS | {"common", "operator", "conductor", "store"} <= parts
    ours = {f"mooncake_k8s.{p}" for p in parts}
    assert set(contract("operator-beside")["forbidden_modules"]) == (
        ours - {"mooncake_k8s.common", "mooncake_k8s.operator"})
    conductor = {f"mooncake_k8s.conductor.{p.stem}" for p in (SERVICES / "conductor").iterdir()
                 if p.name not in ("__init__.py", "sched", "__pycache__")}
    assert set(contract("sched-pure-ours")["forbidden_modules"]) == (
        ours - {"mooncake_k8s.common", "mooncake_k8s.conductor"}) | conductor
    allowed = set(contract("servers-from-entry-points")["allowed_importers"])
    assert {f"mooncake_k8s.{p}" for p in ENTRY_POINTS} <= allowed


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        env = _env(build_view(Path(tmp)))
        cmd = shutil.which("lint-imports") or "lint-imports"
        sys.exit(subprocess.call([cmd, "--config", str(CONFIG), "--no-cache"], cwd=REPO,
                                 env=env))
