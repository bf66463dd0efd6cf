"""Regenerate the gRPC stubs in services/common/rpc/ from proto/*.proto.

Run from anywhere: `python proto/gen.py`. The virtual include path makes the generated modules
import each other as `mooncake_k8s.common.rpc.X_pb2`, so no post-processing is needed.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc  # type: ignore[import-untyped]

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "services" / "common" / "rpc"
VIRTUAL = "mooncake_k8s/common/rpc"


def main() -> int:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{VIRTUAL}={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"{VIRTUAL}/{p.name}" for p in protos),
        ]
        rc = int(protoc.main(args))
        if rc:
            return rc
        for f in (pathlib.Path(tmp) / VIRTUAL).iterdir():
            shutil.copy(f, OUT_DIR / f.name)
            print("wrote", OUT_DIR / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
