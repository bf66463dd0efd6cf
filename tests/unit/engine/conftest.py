"""Fixtures for the engine tests: the real built-in model, loaded once per test session.

The model is converted from its GGUF into the user cache on the first run ever (~30 s) and read
from there afterwards, exactly as `mooncake up` does.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake_k8s.engine.embedded import Engine, EngineConfig, load_engine


@pytest.fixture(scope="session")
def engine() -> Engine:
    # one thread: the CI box has 2 cores and other work; OpenMP spinning collapses under it
    return load_engine(EngineConfig(threads=1), progress=False)


@pytest.fixture
def fresh(engine: Engine) -> Iterator[Engine]:
    """The session engine; the test must leave nothing running (checked, then cleaned)."""
    yield engine
    running = engine.load().running
    for seq_id in list(engine._running):
        engine.abort(seq_id)
    assert running == 0, "a test left sequences running"
