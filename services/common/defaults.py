"""Defaults that several components must agree on, each written once.

A value here is what every process assumes when nothing says otherwise; a cluster that changes
one must change it everywhere (the CLI's options, the operator's renders and the engines all
read these names).
"""

from __future__ import annotations

BLOCK_TOKENS = 64
"""Tokens per KV block: the unit of prefix reuse, of block keys and of store objects. Every
process of one cluster must use the same value (it is part of the block key namespace)."""
