"""Environment variables read outside the CLI's options: the registry beside the CLI.

Every `mooncake` option that takes an environment variable declares it on the option itself
(`envvar=`, shown by `--help`); those are found by walking the command tree. What follows are
the variables code reads directly, each with the module that reads it and why it is not an
option. `docs/environment.md` is generated from both (`python -m mooncake_k8s.cli.envdoc`), and a
test checks that every variable the operator renders into a pod has a reader here or among the
options, and that the document is current.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    reader: str  # the file that reads it, from the repository's root
    meaning: str


READ_DIRECTLY: tuple[EnvVar, ...] = (
    EnvVar("MOONCAKE_STORE_REPLICAS", "services/store/client/client.py",
           "Copies each put makes unless it says otherwise (1..8); what the operator renders "
           "from store.replicationFactor. Read by every StoreClient, so it reaches the engines' "
           "plug-ins in their child processes too (workers also take --store-replicas)."),
    EnvVar("MOONCAKE_ENGINE_ARGS", "services/cli/serving.py",
           "Extra engine arguments as one shell-quoted string (vLLM/SGLang workers); joined "
           "with --engine-arg and the arguments after `--`."),
    EnvVar("MOONCAKE_CLUSTER_TOKEN", "services/engine/sglang/server.py",
           "The cluster token (also every command's --token); handed to the SGLang child so "
           "its KV transfer authenticates."),
    EnvVar("MOONCAKE_KV_LAYERWISE", "services/engine/embedded/structs.py",
           "Embedded prefill: 1 (default) streams each layer's KV to the store as soon as it "
           "is computed, overlapping the transfer with the rest of the forward pass; 0 stores "
           "the blocks after the prefill (the benchmark's baseline). Read when the engine's "
           "config is built."),
    EnvVar("MOONCAKE_TEST_HANG_ENGINE", "services/common/health.py",
           "Tests only: `prefill` or `decode` makes that worker's calls into its engine block "
           "for good (a hung engine), so tests can see liveness fail. Never set it in a "
           "deployment."),
    EnvVar("MOONCAKE_TRACE_FILE", "services/common/tracing.py",
           "Write trace spans as JSON lines to this file (tests and local debugging)."),
    EnvVar("MOONCAKE_POD_INDEX", "services/prefill/pipeline/config.py",
           "The pod's StatefulSet ordinal (downward API, label apps.kubernetes.io/pod-index): "
           "a prefill pipeline stage's `--pipeline-stage auto`, `{group}` and `{index}` "
           "resolve from it (else from the hostname's -<n> suffix)."),
    EnvVar("MOONCAKE_POD_NAME", "operator/rdma_probe.py",
           "The pod's name (downward API); names the host in the RDMA probe's record."),
    EnvVar("MOONCAKE_K8S_SGLANG", "services/engine/sglang/plugin.py",
           "Set to 1 by our worker for the SGLang it starts: the plug-in acts only then."),
    EnvVar("MOONCAKE_PD_HOST", "services/engine/sglang/transfer.py",
           "Set by our worker for its SGLang child: the address peers reach its KV on."),
    EnvVar("MOONCAKE_PD_STATS", "services/engine/sglang/transfer.py",
           "Set by our worker for its SGLang child: where the child writes its transfer counts."),
    EnvVar("MOONCAKE_SGLANG_HOST_RESERVE_MIB", "services/engine/sglang/cpushims.py",
           "SGLang on CPU: host memory (MiB) kept free when sizing the KV pool (default 1024)."),
    EnvVar("MOONCAKE_SGLANG_WAIT_POLL_MS", "services/engine/sglang/cpushims.py",
           "SGLang on CPU: how long an idle scheduler pass sleeps (ms, default 1; 0 spins)."),
)

RENDERED_FOR_SUBSTITUTION: frozenset[str] = frozenset({"MOONCAKE_POD_IP"})
"""Rendered into pods only to be substituted into other variables (`$(MOONCAKE_POD_IP)`)."""
