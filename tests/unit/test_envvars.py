"""One registry of environment variables: every variable the operator renders into a pod has a
reader, every reader's variable is documented, and the document is current."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from mooncake_k8s.cli import main
from mooncake_k8s.cli.envdoc import markdown, option_vars
from mooncake_k8s.common.envvars import READ_DIRECTLY, RENDERED_FOR_SUBSTITUTION

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests/unit/operator/golden"


def rendered_vars() -> set[str]:
    """MOONCAKE_* variables in every container of every golden render (all four examples)."""
    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for e in node.get("env", []) if isinstance(node.get("env"), list) else []:
                if isinstance(e, dict) and str(e.get("name", "")).startswith("MOONCAKE_"):
                    names.add(e["name"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    files = sorted(GOLDEN.glob("*.yaml"))
    assert files, f"no golden renders in {GOLDEN}"
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            walk(doc)
    return names


def test_every_rendered_variable_has_a_reader() -> None:
    readers = set(option_vars(main)) | {v.name for v in READ_DIRECTLY}
    rendered = rendered_vars()
    assert len(rendered) > 20  # the renders were found and walked
    orphans = sorted(rendered - readers - RENDERED_FOR_SUBSTITUTION)
    assert not orphans, f"the operator renders variables nothing reads: {orphans}"


def test_the_registry_names_variables_code_really_reads() -> None:
    for v in READ_DIRECTLY:
        source = (REPO / v.reader).read_text()
        assert re.search(rf'["\']{v.name}["\']', source), f"{v.name} is not read in {v.reader}"


def test_environment_doc_is_current() -> None:
    doc = (REPO / "docs/environment.md").read_text()
    assert doc == markdown(), (
        "docs/environment.md is out of date: run "
        "`python -m mooncake_k8s.cli.envdoc > docs/environment.md`")


def test_every_variable_read_is_documented() -> None:
    doc = (REPO / "docs/environment.md").read_text()
    for name in set(option_vars(main)) | {v.name for v in READ_DIRECTLY}:
        assert f"`{name}`" in doc, name
