"""Shared by the two import stubs in this folder (see README.md): a module whose every attribute
and submodule exists, and whose callables raise when called."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Missing:
    """Stands in for any attribute; usable as a base class and in annotations, never called."""

    def __init__(self, name: str, error: type[Exception]) -> None:
        self._name = name
        self._error = error

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return Missing(f"{self._name}.{key}", self._error)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._error(f"{self._name} is not available on this CPU build (import-only stub)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class StubModule(types.ModuleType):
    error: type[Exception] = RuntimeError
    special: dict[str, Any] = {}

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        if key in self.special:
            return self.special[key]
        return Missing(f"{self.__name__}.{key}", self.error)


def install(prefix: str, error: type[Exception], special: dict[str, Any]) -> None:
    """Serve every `prefix.*` submodule as a StubModule."""

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any, target: Any = None
                      ) -> importlib.machinery.ModuleSpec | None:
            if name.startswith(prefix + "."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
            mod = StubModule(spec.name)
            mod.error = error
            mod.special = special
            mod.__path__ = []
            return mod

        def exec_module(self, module: types.ModuleType) -> None:
            return None

    sys.meta_path.insert(0, Finder())
    top = sys.modules[prefix]
    top.__class__ = StubModule
    top.error = error  # type: ignore[attr-defined]
    top.special = special  # type: ignore[attr-defined]
