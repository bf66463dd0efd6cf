"""The distributed KV store, cut by side.

- `master/`: the master process (`server`), its RPC handlers (`servicer`, `fastpath`) and its
  state as plain Python (`state.MasterState` and the parts it is made of), HA and recovery;
- `node/`: the storage node process that serves segments and follows the master's commands;
- `client/`: what callers link: `StoreClient`, the link to whichever master leads, the page
  pools the engines' cache plug-ins use;
- `wire`: what the sides agree on (trailers, error codes both ways, replica locations, the
  fast path's frames), imported by every side and importing none;
- `local`: the public embedding API (a DRAM segment served from inside another process);
- `cluster`: a store on loopback as child processes (`mooncake store demo`), extended for
  tests by `testing`.

The master's state imports neither gRPC nor the client; the client and the node never import
the master (tests/unit/test_import_contract.py).
"""
