"""`mooncake render -f FILE` on malformed input, run as the real CLI in a subprocess: every
case exits 1 with a message naming the file, document and field, prints no objects, and never
a Python traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HEAD = "apiVersion: mooncake.io/v1alpha1\nkind: MooncakeCluster\n"
GOOD = HEAD + "metadata: {name: good}\nspec: {}\n"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefg", "bcdefgh", strict=True))


def _run(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    # cwd is the temporary folder: the repository's `operator/` must not shadow the stdlib.
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run([sys.executable, "-m", "mooncake_k8s.cli", "render", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


# (id, file content, what stderr must say; {f} is the file's path)
MALFORMED: list[tuple[str, str | bytes, str]] = [
    ("yaml-syntax", HEAD + "metadata: {name: x}\nspec: [\n",
     "{f}:5:1: not valid YAML: while parsing a flow node expected the node content"),
    ("yaml-bad-indent", HEAD + "metadata:\n  name: x\n bad: 1\n",
     "{f}:5:2: not valid YAML:"),
    ("empty-file", "", "{f}: no documents (the file is empty or only comments)"),
    ("only-comments", "# nothing\n---\n", "{f}: no documents"),
    ("plain-string", "hello\n", "{f}: a MooncakeCluster is a mapping with apiVersion, kind, "
                                "metadata and spec, got a string"),
    ("a-list", "- kind: MooncakeCluster\n", "{f}: a MooncakeCluster is a mapping with "
                                             "apiVersion, kind, metadata and spec, got a list"),
    ("metadata-null", HEAD + "metadata: null\nspec: {}\n",
     "  - metadata: must be a mapping with at least a name, got null"),
    ("spec-null", HEAD + "metadata: {name: x}\nspec: null\n",
     "{f}: MooncakeCluster/x is invalid:\n  - spec: null is not of type 'object'"),
    ("unknown-kind", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n",
     "{f}: Pod/p is invalid:\n  - apiVersion: 'v1' is not served here; expected apiVersion "
     "mooncake.io/v1alpha1\n  - kind: 'Pod' is not served here; expected kind MooncakeCluster"),
    ("unknown-api-version", "apiVersion: mooncake.io/v2\nkind: MooncakeCluster\n"
                            "metadata: {name: x}\nspec: {}\n",
     "  - apiVersion: 'mooncake.io/v2' is not served here"),
    ("duplicate-key", HEAD + "metadata: {name: x}\nspec: {}\nspec: {image: y}\n",
     "{f}:5:1: not valid YAML: duplicate key 'spec'"),
    ("not-utf8", b"\xff\xfe\x00garbage", "{f}: not UTF-8 text (byte 0xff at offset 0)"),
    ("alias-bomb", BOMB, "{f}: expands to more than 1000000 values through YAML aliases"),
    ("quantity-lots", HEAD + "metadata: {name: x}\nspec:\n  roles:\n    prefill:\n"
                             "      resources: {requests: {memory: lots}}\n",
     "  - spec.roles.prefill.resources.requests.memory: 'lots' is not a quantity"),
    ("dram-zero", HEAD + "metadata: {name: x}\nspec: {store: {dramPerNode: 0}}\n",
     "  - spec.store.dramPerNode: 0 is below 1Mi"),
    ("several-documents", GOOD + "---\nhello\n---\n" + HEAD +
     "metadata: {name: bad}\nspec: {roles: {prefill: {tolerations: [{operator: Maybe}]}}}\n",
     "{f} document 2: a MooncakeCluster is a mapping with apiVersion, kind, metadata and spec, "
     "got a string\n{f} document 3: MooncakeCluster/bad is invalid:\n"
     "  - spec.roles.prefill.tolerations[0].operator: 'Maybe' is not one of"),
]


@pytest.mark.parametrize(("content", "expected"), [(c, e) for _, c, e in MALFORMED],
                         ids=[i for i, _, _ in MALFORMED])
def test_malformed_input_gets_a_message_not_a_traceback(tmp_path: Path, content: str | bytes,
                                                        expected: str) -> None:
    f = tmp_path / "cluster.yaml"
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    r = _run(tmp_path, f)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""  # nothing half-rendered
    assert r.stderr.startswith("Error: "), r.stderr
    assert expected.format(f=f) in r.stderr, r.stderr


def test_every_file_and_document_is_rendered_when_all_are_valid(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD + "---\n# trailing empty document\n")
    b.write_text(GOOD.replace("good", "other") + "---\n" + GOOD.replace("good", "third"))
    r = _run(tmp_path, a, b)
    assert r.returncode == 0, r.stderr
    names = {d["metadata"]["labels"]["app.kubernetes.io/instance"]
             for d in yaml.safe_load_all(r.stdout)}
    assert names == {"good", "other", "third"}


def test_an_error_in_one_file_prints_nothing_for_the_others(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD)
    b.write_text("spec: [")
    r = _run(tmp_path, a, b)
    assert r.returncode == 1 and r.stdout == ""
    assert f"{b}:1:8: not valid YAML" in r.stderr and str(a) not in r.stderr
