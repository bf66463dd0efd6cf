"""How a restarted master avoids answering from half its metadata.

The master's metadata is soft: it lives in memory and is rebuilt from the storage nodes'
inventories when they register again. Between the master's start and the last node's
re-registration, "not found" would be a lie (the object is on a node that has not re-registered
yet), and callers act on misses: they recompute KV blocks and put them again. So until the
rebuild is done, `RecoveryGate` makes the master answer lookups and puts with UNAVAILABLE, which
clients retry.

Done means: every node the master knew before it restarted has registered again, or a grace
period has passed (a node that died with the master must not hold the cluster hostage). Which
nodes it knew comes from `NodeRoster`, a small file under `--state-dir` that the master rewrites
whenever its set of registered nodes changes. Without a state directory a master cannot tell a
first start from a restart, so it waits for the whole grace period; with one, a first start
(no roster file yet) is not gated at all and a restart ends as soon as the roster is complete.

Used by `master.MasterServer` (the gRPC shell); `MasterState` knows nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

ROSTER_FILE = "nodes.json"


class NodeRoster:
    """The ids of the nodes registered with the master, persisted in one JSON file.

    Written atomically (temporary file, fsync, rename) so a master killed mid-write leaves the
    previous roster, never a torn one. Only rewritten when the set changes.
    """

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / ROSTER_FILE
        self._saved: frozenset[str] | None = None

    def load(self) -> frozenset[str] | None:
        """The saved node ids; empty when there is no roster yet (this master's first start).

        None when the roster is unreadable or malformed: the nodes are unknown (assuming none
        would be unsafe), so the caller waits for the whole grace period. Logged.
        """
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return frozenset()
        except OSError as e:
            log.warning("cannot read the node roster", extra={"path": str(self.path),
                                                              "error": str(e)})
            return None
        try:
            data = json.loads(text)
            ids = data["nodes"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("'nodes' must be a list of strings")
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring a malformed node roster", extra={"path": str(self.path),
                                                                   "error": str(e)})
            return None
        self._saved = frozenset(ids)
        return self._saved

    def save(self, node_ids: Iterable[str]) -> bool:
        """Persist `node_ids` if they differ from what was saved last; True if written."""
        ids = frozenset(node_ids)
        if ids == self._saved:
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".nodes-", dir=self.dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"nodes": sorted(ids), "saved_unix_ms": int(time.time() * 1000)}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._saved = ids
        return True


class RecoveryGate:
    """Closed while the master is rebuilding its metadata; see the module docstring.

    `expected` is the set of node ids to wait for: None means unknown (wait for the grace
    period), an empty set means nothing to wait for (open at once). Thread-safe.
    """

    def __init__(
        self,
        expected: frozenset[str] | None,
        grace_s: float,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if grace_s < 0:
            raise ValueError(f"recovery grace must be >= 0 s, got {grace_s}")
        self._now = now
        self._lock = threading.Lock()
        self._deadline = now() + grace_s
        self._expected = expected
        self._seen: set[str] = set()
        self._open = grace_s == 0 or expected == frozenset()
        self._reason = "nothing to rebuild" if self._open else ""

    @property
    def is_open(self) -> bool:
        """True once the master may answer authoritatively (never closes again)."""
        if self._open:
            return True
        with self._lock:
            if not self._open and self._now() >= self._deadline:
                self._opened("grace period over")
            return self._open

    def registered(self, node_id: str) -> None:
        """Note that `node_id` (re-)registered; opens the gate when it completes the roster."""
        if self._open:
            return
        with self._lock:
            self._seen.add(node_id)
            if (not self._open and self._expected is not None
                    and self._expected <= self._seen):
                self._opened("every known node re-registered")

    def describe(self) -> str:
        """Why lookups are refused right now (for the UNAVAILABLE message)."""
        with self._lock:
            left = max(0.0, self._deadline - self._now())
            if self._expected is None:
                known = f"{len(self._seen)} nodes re-registered so far"
            else:
                back = len(self._expected & self._seen)
                known = f"{back} of {len(self._expected)} known nodes re-registered"
        return (f"the master restarted and is rebuilding its metadata from the storage nodes "
                f"({known}, at most {left:.1f}s left); retry")

    def _opened(self, why: str) -> None:
        self._open = True
        self._reason = why
        missing = sorted((self._expected or frozenset()) - self._seen)
        log.info("metadata recovery done", extra={"reason": why, "nodes": len(self._seen),
                                                  "missing": ",".join(missing[:20])})
