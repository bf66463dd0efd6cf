"""Counters an engine plug-in (vLLM connector, SGLang HiCache backend, SGLang transfer engine)
hands to the worker that started the engine.

The plug-ins run inside the engine's own processes, which the worker cannot call into; each
writes a small JSON snapshot the worker sums when it is scraped (`EngineChild.connector_stats`).
One process can hold several plug-ins (SGLang's scheduler holds both the HiCache backend and
the PD transfer engine; vLLM's engine core can hold both connector roles), so the file is named
by plug-in *and* pid: two writers sharing one file would erase each other's counts.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def stats_path(prefix: str | os.PathLike[str] | None, part: str) -> Path | None:
    """`<prefix>.<part>-<pid>.json`, or None when the worker asked for no counters."""
    if not prefix:
        return None
    return Path(f"{prefix}.{part}-{os.getpid()}.json")


def write_stats(path: Path | None, stats: dict[str, int]) -> None:
    """Replace the snapshot whole (the reader never sees half a file); a full disk or a removed
    directory costs the counters, never the request that moved the pages."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, path)
