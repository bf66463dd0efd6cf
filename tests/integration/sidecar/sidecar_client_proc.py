"""A second client process: puts (or gets and checks) pages through the sidecar, prints JSON.

    sidecar_client_proc.py SOCKET put|get PREFIX N SIZE SEED
"""

from __future__ import annotations

import json
import sys

import numpy as np

from mooncake_k8s.sidecar.client import SidecarPagePool
from mooncake_k8s.sidecar.testing import Pages, page_bytes


def main() -> None:
    sock, op, prefix = sys.argv[1:4]
    n, size, seed = (int(a) for a in sys.argv[4:7])
    pages = Pages(n, size)
    keys = [f"{prefix}-{i}" for i in range(n)]
    with SidecarPagePool(sock) as pool:
        if op == "put":
            for i in range(n):
                pages.fill_from(seed, i)
            print(json.dumps({"ok": pool.put_pages(keys, pages.all())}))
        else:
            ok = pool.get_pages(keys, pages.all())
            match = [bool(np.array_equal(pages.content(i), page_bytes(seed, i, size)))
                     for i in range(n)]
            print(json.dumps({"ok": ok, "match": match}))


if __name__ == "__main__":
    main()
