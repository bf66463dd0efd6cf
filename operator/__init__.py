"""The Kubernetes operator for MooncakeCluster (imported as `mooncake_k8s.operator`).

Layers, lowest first; a module imports only from layers below it:

- pure, no I/O and no kopf: `schema` (the CRD schemas), `naming` (names, labels, revisions),
  `pods` (pod templates, built from `pods_sizing`, `pods_context`, `pods_volumes` and
  `pods_env`) and `render` (spec -> objects), `validation` (offline admission), `metrics`,
  `status` (children -> status), `autoscaler` (metrics -> replicas), `crds`, `rdma_probe`;
- I/O: `kube` (a small API client for server-side apply), `reconcile` (one reconcile);
- kopf: `handlers` (thin handlers over `reconcile`);
- `cli`: the `mooncake render | operator | rdma-probe | crds` commands.

A unit test enforces that the pure layer never imports kopf, aiohttp or a Kubernetes client.
"""
