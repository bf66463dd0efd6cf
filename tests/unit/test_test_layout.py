"""The test tree's own rule: test modules have unique basenames.

The test folders are not packages, so pytest imports each test module under its basename
alone: two `test_plan.py` in different folders make collection fail ("import file mismatch")
for the whole run, which a run of one folder does not show.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_modules_have_unique_basenames() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (rename one of each): {clashes}"
