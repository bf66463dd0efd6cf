"""The P2P store: large read-mostly directories (model weights, checkpoints) published as
verified chunks that every host holding them serves (see `api` and `holders`)."""

from mooncake_k8s.store.p2p.api import GetResult, get, load_manifest, publish
from mooncake_k8s.store.p2p.manifest import Manifest, build, decode

__all__ = ["GetResult", "Manifest", "build", "decode", "get", "load_manifest", "publish"]
