"""Helper process for the transfer integration tests (not a test module).

Usage: python transfer_server_proc.py TOKEN SSD_DIR [SERVER_KWARGS_JSON]
Creates a 64 MiB DRAM segment and a 32 MiB SSD segment, serves them on 127.0.0.1, prints one
JSON line (address, listener host, segment descriptors) and runs until stdin closes; then it
stops and removes its segment files.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from mooncake_k8s.transfer import Segment, TransferServer

MiB = 1 << 20


def main() -> None:
    token, ssd_dir = sys.argv[1], sys.argv[2]
    kwargs = {"io_timeout_s": 5.0, **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})}
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    tag = f"it{os.getpid()}"
    dram = Segment.create_shm(f"{tag}-dram", 64 * MiB)
    ssd = Segment.create_file(f"{tag}-ssd", ssd_dir, 32 * MiB)
    server = TransferServer(
        {dram.desc.name: dram, ssd.desc.name: ssd}, "127.0.0.1", 0, token, **kwargs
    )
    server.start()
    segs = [
        {"name": s.desc.name, "tier": s.desc.tier.value, "size": s.desc.size, "path": s.desc.path}
        for s in (dram, ssd)
    ]
    print(json.dumps({"address": server.address, "segments": segs}), flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
        dram.close()
        ssd.close()


if __name__ == "__main__":
    main()
