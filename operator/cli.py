"""The operator's `mooncake` subcommands: render, operator, rdma-probe and crds.

`services/cli/main.py` adds these to the main group. Everything heavy (kopf, jsonschema, the CEL
interpreter) is imported inside the command that needs it, so `mooncake --help` and
`mooncake operator --help` stay fast and work without those packages.
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any, BinaryIO

import click


@click.command("render")
@click.option("-f", "--filename", "files", multiple=True, required=True,
              type=click.File("rb"), help="MooncakeCluster YAML ('-' reads stdin); repeatable.")
@click.option("-n", "--namespace", default=None,
              help="Namespace for resources that do not set metadata.namespace [default: "
                   "default].")
def render(files: tuple[BinaryIO, ...], namespace: str | None) -> None:
    """Print, as a YAML stream, exactly the objects the operator applies for each cluster.

    The input is defaulted and validated as the API server would (OpenAPI schema and CEL
    rules), plus Kubernetes' own rules for the pod fields it carries (resources, nodeSelector,
    tolerations, affinity, names) and rules across fields. Any problem in any document is
    reported (file, document, field) and nothing is printed; the exit status is then 1.
    ownerReferences are included only when the input carries metadata.uid (e.g.
    `kubectl get mcc NAME -o yaml | mooncake render -f -`). Not printed: the cluster-token
    Secret the operator generates once when spec.clusterTokenSecret is unset.
    """
    import yaml

    from mooncake_k8s.operator import render as rnd
    from mooncake_k8s.operator.manifests import ManifestError, documents, label
    from mooncake_k8s.operator.validation import InvalidResource, validate_cluster

    out: list[dict[str, Any]] = []
    problems: list[str] = []
    for f in files:
        name = getattr(f, "name", "-")
        try:
            docs = documents(f.read(), name)
        except ManifestError as e:
            problems.append(str(e))
            continue
        for i, doc in enumerate(docs, 1):
            where = label(name, i, len(docs), doc)
            if namespace and isinstance(doc, dict) and isinstance(doc.get("metadata"), dict) \
                    and not doc["metadata"].get("namespace"):
                doc["metadata"]["namespace"] = namespace
            try:
                out += rnd.render(validate_cluster(doc)).objects
            except InvalidResource as e:
                if len(e.errors) == 1 and e.errors[0].startswith("<root>: "):
                    problems.append(f"{where}: {e.errors[0].removeprefix('<root>: ')}")
                else:
                    problems.append(f"{where} is invalid:\n" +
                                    "\n".join(f"  - {m}" for m in e.errors))
            except rnd.SpecError as e:
                problems.append(f"{where}: {e}")
    if problems:
        raise click.ClickException("\n".join(problems))
    click.echo(yaml.safe_dump_all(out, sort_keys=False, width=100), nl=False)


@click.command("operator")
@click.option("--namespace", "namespaces", multiple=True, envvar="MOONCAKE_OPERATOR_NAMESPACES",
              show_envvar=True,
              help="Watch only this namespace (repeatable; the env var is space-separated). "
                   "Without any, watch the whole cluster.")
@click.option("--peering", envvar="MOONCAKE_OPERATOR_PEERING", default=None, show_envvar=True,
              help="kopf peering name for HA: replicas with the same name elect the "
                   "highest-priority one to work. Without it, run standalone.")
@click.option("--priority", envvar="MOONCAKE_OPERATOR_PRIORITY", type=int, default=None,
              show_envvar=True, help="Peering priority [default: random, so replicas differ].")
@click.option("--listen-host", envvar="MOONCAKE_OPERATOR_LISTEN_HOST", default="127.0.0.1",
              show_default=True, show_envvar=True,
              help="Address of the metrics and liveness endpoints (the pod IP in a pod).")
@click.option("--metrics-port", envvar="MOONCAKE_OPERATOR_METRICS_PORT", default=8080,
              show_default=True, show_envvar=True, type=click.IntRange(-1, 65535),
              help="Prometheus /metrics port; -1 = off.")
@click.option("--health-port", envvar="MOONCAKE_OPERATOR_HEALTH_PORT", default=8081,
              show_default=True, show_envvar=True, type=click.IntRange(-1, 65535),
              help="kopf liveness endpoint /healthz port; -1 = off.")
@click.option("--sync-interval", envvar="MOONCAKE_OPERATOR_SYNC_INTERVAL", default=15.0,
              show_default=True, show_envvar=True, type=click.FloatRange(1.0),
              help="Seconds between status/autoscaler passes per cluster.")
@click.option("--resync-interval", envvar="MOONCAKE_OPERATOR_RESYNC_INTERVAL", default=300.0,
              show_default=True, show_envvar=True, type=click.FloatRange(10.0),
              help="Seconds between unconditional re-applies (drift repair).")
@click.option("--verbose", is_flag=True, envvar="MOONCAKE_OPERATOR_VERBOSE", show_envvar=True,
              help="Debug logging.")
def operator(namespaces: tuple[str, ...], peering: str | None, priority: int | None,
             listen_host: str, metrics_port: int, health_port: int, sync_interval: float,
             resync_interval: float, verbose: bool) -> None:
    """Run the MooncakeCluster operator (kopf)."""
    import asyncio

    import kopf
    from prometheus_client import start_http_server

    from mooncake_k8s.operator.handlers import build_registry
    from mooncake_k8s.operator.reconcile import OperatorConfig

    ns = [n for item in namespaces for n in item.replace(",", " ").split() if n]
    if priority is None:
        priority = secrets.randbelow(1 << 30) + 1 if peering else 0
    config = OperatorConfig(namespaces=ns or None, sync_interval_s=sync_interval,
                            resync_interval_s=resync_interval, peering=peering,
                            priority=priority)
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON)
    if metrics_port >= 0:
        start_http_server(metrics_port, addr=listen_host)
    liveness = (f"http://{listen_host}:{health_port}/healthz" if health_port >= 0 else None)
    asyncio.run(kopf.operator(
        registry=build_registry(config), standalone=peering is None, peering_name=peering,
        priority=priority, namespaces=ns, clusterwide=not ns, liveness_endpoint=liveness))


@click.command("rdma-probe")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the JSON record here (a shared emptyDir in pods).")
@click.option("--termination-log", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("/dev/termination-log"), show_default=True,
              help="Where the kubelet picks up the record for the pod status.")
@click.option("--required", is_flag=True, help="Exit 1 when no usable RDMA device is found.")
@click.option("--sys-root", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/sys"), show_default=True, hidden=True)
@click.option("--dev-root", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/dev"), show_default=True, hidden=True)
@click.option("--no-pyverbs", is_flag=True, hidden=True, help="Read sysfs only.")
def rdma_probe(output: Path | None, termination_log: Path, required: bool, sys_root: Path,
               dev_root: Path, no_pyverbs: bool) -> None:
    """Find usable RDMA devices and print a JSON record (exit 0 unless --required)."""
    from mooncake_k8s.operator.rdma_probe import probe, write_outputs

    record = probe(sys_root, dev_root, use_pyverbs=not no_pyverbs)
    write_outputs(record, output, termination_log)
    click.echo(json.dumps(record, sort_keys=True))
    if not record["usable"]:
        click.echo(f"rdma-probe: {record['reason']}", err=True)
        if required:
            sys.exit(1)


@click.command("crds")
@click.option("--write", "repo", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Regenerate crds/ and the mooncake-crds chart under this repository root.")
def crds(repo: Path | None) -> None:
    """Print the CustomResourceDefinitions (or regenerate the checked-in copies)."""
    import yaml

    from mooncake_k8s.operator import crds as gen

    if repo is not None:
        for p in gen.write_all(repo):
            click.echo(f"wrote {p}")
        return
    click.echo(yaml.safe_dump_all(list(gen.all_crds().values()), sort_keys=False, width=100),
               nl=False)


COMMANDS = (render, operator, rdma_probe, crds)
