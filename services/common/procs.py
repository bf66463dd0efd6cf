"""A child process this project started: its command line, log file and metrics port.

Shared by `mooncake up`'s supervisor and the store's loopback launcher (`store.cluster`, which
the test harness `store.testing` extends), so neither imports the other.
"""

from __future__ import annotations

import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Proc:
    name: str
    args: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())
