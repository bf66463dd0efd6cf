"""The transfer sidecar: the pod container that owns the store client and staging memory,
and the client library engines use to reach it over a Unix socket (see `server`)."""
