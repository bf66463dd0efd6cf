"""The `mooncake` command line: one package, a module per command group.

`main` (the click group, `mooncake = "mooncake_k8s.cli:main"`) holds the store commands and
gathers the others: `serving` (prefill, decode, conductor, up), `sched` (replay, analyze,
calibrate), `sidecar`, and the operator's (`operator.cli`). `options` holds the options several
commands share (masters, sizes, the token, the bind guard); `envdoc` writes
docs/environment.md from the command tree. `python -m mooncake_k8s.cli` runs `main`.
"""

from mooncake_k8s.cli.main import main

__all__ = ["main"]
