"""Reading manifest files for `mooncake render`: bytes in, YAML documents out, or one line
that says what is wrong and where.

kubectl decodes strictly (duplicate keys are errors) and bounds YAML alias expansion; PyYAML's
`safe_load_all` does neither, and its exceptions print as multi-line tracebacks. This module
closes that gap so the CLI can promise a message, never a traceback or a hang, for any file.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

# More values than any MooncakeCluster needs; far fewer than an alias bomb expands to.
MAX_VALUES = 1_000_000


class ManifestError(ValueError):
    """The file is not a YAML stream of documents; the message is one line naming it."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, as the API server's strict decoding does
    (PyYAML would keep the last one silently)."""


def _mapping(loader: _StrictLoader, node: MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=True))


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def documents(data: bytes, name: str) -> list[Any]:
    """The non-empty documents of a YAML stream, or a ManifestError."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{name}: not UTF-8 text (byte {data[e.start]:#04x} at offset "
                            f"{e.start})") from e
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        what = " ".join(filter(None, (e.context, e.problem)))
        raise ManifestError(f"{where}: not valid YAML: {what}") from e
    except yaml.YAMLError as e:
        raise ManifestError(f"{name}: not valid YAML: {' '.join(str(e).split())}") from e
    except RecursionError as e:
        raise ManifestError(f"{name}: not valid YAML: nested too deeply") from e
    if not docs:
        raise ManifestError(f"{name}: no documents (the file is empty or only comments)")
    for i, doc in enumerate(docs, 1):
        _check_size(doc, label(name, i, len(docs), doc))
    return docs


def _check_size(doc: Any, where: str) -> None:
    """Refuse documents that expand, through aliases, to more than MAX_VALUES values or that
    contain themselves; either would make every later step hang or overflow the stack."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(v: Any) -> int:
        if not isinstance(v, dict | list):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        if id(v) in active:
            raise ManifestError(f"{where}: a YAML alias makes the document contain itself")
        active.add(id(v))
        children = list(v.values()) if isinstance(v, dict) else v
        n = 1 + sum(size(c) for c in children)
        active.discard(id(v))
        if n > MAX_VALUES:
            raise ManifestError(f"{where}: expands to more than {MAX_VALUES} values through "
                                "YAML aliases")
        sizes[id(v)] = n
        return n

    try:
        size(doc)
    except RecursionError as e:
        raise ManifestError(f"{where}: nested too deeply") from e


def label(name: str, index: int, count: int, doc: Any) -> str:
    """How messages name a document: the file, its position when the file holds several, and
    Kind/name when the document says them."""
    head = name if count == 1 else f"{name} document {index}"
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    if isinstance(meta, dict) and isinstance(doc.get("kind"), str) and isinstance(
            meta.get("name"), str):
        return f"{head}: {doc['kind']}/{meta['name']}"
    return head
