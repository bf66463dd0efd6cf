"""The client side of the store: `StoreClient` (the embedding API for puts and gets), the link
to whichever master leads, and the page pools the engines' cache plug-ins use."""

from mooncake_k8s.store.client.client import StoreClient
from mooncake_k8s.store.wire import SegmentInfo

__all__ = ["SegmentInfo", "StoreClient"]
