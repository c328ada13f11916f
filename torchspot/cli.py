"""`torchspot`: the command line for the lab.

    torchspot lab run JOB.yaml [--scenario SCENARIO.yaml] [--out DIR] [--code FOLDER]

runs an ElasticJob in the local sandbox (lab/torchspot_lab/sandbox.py) through a scripted spot
market (lab/torchspot_lab/scenario.py) and prints the report; with --code, a job written for your
own image runs its script from FOLDER instead (examples/ddp/elasticjob.yaml, --code examples/ddp).
A bad job or scenario file stops it before anything starts, with a message that names the problem.

    torchspot evict node NAME [--hard]

rehearses a spot eviction on the cluster the kubeconfig points at (lab/torchspot_lab/evict.py).

    torchspot evict aks --resource-group RG --cluster NAME --node NODE
    torchspot aks spot-pool create|scale --resource-group RG --cluster NAME --name POOL ...

evict an AKS node's VM for real (simulate-eviction), and make or resize a GPU spot
pool (lab/torchspot_lab/azure.py), with DefaultAzureCredential and AZURE_SUBSCRIPTION_ID or
--subscription.

    torchspot data prepare SOURCE az://container/prefix [--short-side 288]

writes an ImageNet-style folder as shards of pre-resized JPEGs that a node copies and unpacks
before it joins (trainer/torchspot_trainer/data/prepare.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from torchspot_lab.azure import EVICTION_POLICIES, SPOT_MAX_PRICE_ANY
    from torchspot_lab.scenario import Scenario, ScenarioError, load_scenario
except ModuleNotFoundError as missing:  # the distribution without extras: a worker's runtime only
    raise SystemExit(
        f"torchspot: {missing.name} is not installed: the `torchspot` command needs the operator's packages "
        "(pip install 'torchspot[operator]'; 'torchspot[lab]' for `torchspot lab run`)"
    ) from None

if TYPE_CHECKING:
    from torchspot_operator.kube import Kube

DEFAULT_OUT = Path("runs")


def build_parser() -> argparse.ArgumentParser:
    """The `torchspot` parser and its subcommands."""
    parser = argparse.ArgumentParser(prog="torchspot", description="Elastic PyTorch training on spot node pools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {metadata.version('torchspot')}")
    commands = parser.add_subparsers(dest="command", required=True)
    lab = commands.add_parser("lab", help="the local sandbox").add_subparsers(dest="lab_command", required=True)
    run = lab.add_parser("run", help="run an ElasticJob in the local sandbox through a scripted spot market")
    run.add_argument("job", type=Path, help="an ElasticJob YAML file")
    run.add_argument("--scenario", type=Path, help="a scenario YAML file (default: 3 spot nodes, no events)")
    run.add_argument(
        "--code", type=Path, help="a local folder with the job's script (a job for your own image: its first argument)"
    )
    run.add_argument(
        "--out", type=Path, default=None, help="folder for logs and the report (default: runs/<job>-<time>)"
    )
    data = commands.add_parser("data", help="data sets").add_subparsers(dest="data_command", required=True)
    prepare = data.add_parser(
        "prepare", help="write an ImageNet-style folder to Blob as shards of pre-resized JPEGs (for --data az://...)"
    )
    prepare.add_argument("source", type=Path, help="a folder with train/ and val/, one folder per class in each")
    prepare.add_argument("dest", help="az://container/prefix (credentials as for checkpoints) or a folder")
    prepare.add_argument("--short-side", type=int, default=288, help="shrink each image to this shorter side (288)")
    prepare.add_argument("--shard-images", type=int, default=1000, help="images per shard (1000)")
    prepare.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (90)")
    prepare.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (the cores)")
    evict = commands.add_parser("evict", help="rehearse a spot eviction")
    kinds = evict.add_subparsers(dest="evict_command", required=True)
    node = kinds.add_parser("node", help="cordon a node and delete its pods with their grace period (any cluster)")
    node.add_argument("name", help="the node's name (kubectl get nodes)")
    node.add_argument("--hard", action="store_true", help="delete the pods at once (grace 0), as when a VM vanishes")
    aks_evict = kinds.add_parser("aks", help="evict an AKS node's spot VM through Azure (simulate-eviction)")
    _azure_target(aks_evict)
    aks_evict.add_argument("--node", required=True, help="the Kubernetes node name (its provider ID names the VM)")
    aks = commands.add_parser("aks", help="AKS spot node pools").add_subparsers(dest="aks_command", required=True)
    pool = aks.add_parser("spot-pool", help="create or resize a GPU spot node pool")
    actions = pool.add_subparsers(dest="pool_command", required=True)
    create = actions.add_parser("create", help="create (or update) a spot pool")
    _azure_target(create)
    create.add_argument("--name", required=True, help="the pool's name (1-12 lowercase letters and digits)")
    create.add_argument("--vm-size", required=True, help="for example Standard_NC4as_T4_v3")
    create.add_argument(
        "--max-price", type=float, default=SPOT_MAX_PRICE_ANY, help="USD per hour, or -1: up to on-demand"
    )
    create.add_argument(
        "--eviction-policy",
        default=EVICTION_POLICIES[0],
        help=f"{' or '.join(EVICTION_POLICIES)} (default {EVICTION_POLICIES[0]})",
    )
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="node label (repeatable)")
    create.add_argument(
        "--taint", action="append", default=[], metavar="KEY=VALUE:EFFECT", help="node taint (repeatable)"
    )
    _limits(create)
    scale = actions.add_parser("scale", help="change a spot pool's autoscaler limits")
    _azure_target(scale)
    scale.add_argument("--name", required=True, help="the pool's name")
    _limits(scale)
    return parser


def _azure_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resource-group", required=True, help="the cluster's resource group")
    parser.add_argument("--cluster", required=True, help="the AKS cluster's name")
    parser.add_argument("--subscription", default=None, help="subscription id (default: $AZURE_SUBSCRIPTION_ID)")


def _limits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min", type=int, required=True, dest="min_count", help="autoscaler minimum nodes")
    parser.add_argument("--max", type=int, required=True, dest="max_count", help="autoscaler maximum nodes")
    parser.add_argument("--count", type=int, default=None, help="nodes now (default: kept within min..max)")


def _subscription(args: argparse.Namespace, command: str) -> str | None:
    import os  # noqa: PLC0415

    found = args.subscription or os.environ.get("AZURE_SUBSCRIPTION_ID")
    if not found:
        print(f"torchspot {command}: error: give --subscription or set AZURE_SUBSCRIPTION_ID", file=sys.stderr)
    return found


def _azure(args: argparse.Namespace) -> int:
    from azure.core.exceptions import HttpResponseError  # noqa: PLC0415

    from torchspot_lab import azure  # noqa: PLC0415

    command = "evict aks" if args.command == "evict" else "aks spot-pool"
    try:
        pool = _pool(args) if args.command == "aks" and args.pool_command == "create" else None
        subscription = _subscription(args, command)
        if subscription is None:
            return 2
        from azure.identity import DefaultAzureCredential  # noqa: PLC0415

        compute, aks = azure.clients(DefaultAzureCredential(), subscription)
        if args.command == "evict":
            provider_id = _provider_id(args.node)
            instance = azure.simulate_eviction(compute, aks, resource_group=args.resource_group,
                                               cluster=args.cluster, provider_id=provider_id)  # fmt: skip
            print(f"simulate-eviction sent for {args.node} ({instance.scale_set} instance {instance.instance_id})")
        elif pool is not None:
            done = azure.create_spot_pool(aks, resource_group=args.resource_group, cluster=args.cluster, pool=pool)
            print(f"spot pool {pool.name}: {done.get('properties', {}).get('provisioningState')}")
        else:
            done = azure.scale_spot_pool(aks, resource_group=args.resource_group, cluster=args.cluster,
                                         name=args.name, min_count=args.min_count, max_count=args.max_count,
                                         count=args.count)  # fmt: skip
            print(f"spot pool {args.name}: {done.get('properties', {}).get('provisioningState')}")
    except azure.AzureInputError as exc:
        print(f"torchspot {command}: error: {exc}", file=sys.stderr)
        return 2
    except HttpResponseError as exc:
        print(f"torchspot {command}: error: Azure refused: {exc.message}", file=sys.stderr)
        return 1
    return 0


def _pool(args: argparse.Namespace) -> Any:
    """The SpotPool the create flags describe, checked (AzureInputError names the bad flag)."""
    from torchspot_lab.azure import AzureInputError, SpotPool  # noqa: PLC0415

    bad = [item for item in args.label if "=" not in item]
    if bad:
        raise AzureInputError(f"--label {bad[0]!r}: expected KEY=VALUE")
    labels = dict(item.split("=", 1) for item in args.label)
    pool = SpotPool(args.name, args.vm_size, args.min_count, args.max_count, args.count,
                    args.max_price, args.eviction_policy, labels, tuple(args.taint))  # fmt: skip
    pool.check()
    return pool


KUBECONFIG_HINT = "set KUBECONFIG or ~/.kube/config"


def _kube() -> Kube | None:
    """An API session with the kubeconfig's cluster and credentials (as kubectl uses), or None without one."""
    from torchspot_operator.kube import Kube, login  # noqa: PLC0415

    info = login(trust_env=True)  # HTTPS_PROXY and NO_PROXY apply, as for kubectl
    return None if info is None else Kube.from_connection(info)


def _provider_id(node: str) -> str:
    """The node's spec.providerID, read through the kubeconfig's cluster."""
    import asyncio  # noqa: PLC0415

    from torchspot_lab.azure import AzureInputError  # noqa: PLC0415
    from torchspot_operator.kube import LoginError  # noqa: PLC0415

    try:
        kube = _kube()
    except LoginError as exc:
        raise AzureInputError(str(exc)) from exc
    if kube is None:
        raise AzureInputError(f"no kubeconfig to look the node up with ({KUBECONFIG_HINT})")

    async def read() -> dict[str, object] | None:
        try:
            return await kube.get("v1", "nodes", None, node)
        finally:
            await kube.close()

    body = asyncio.run(read())
    if body is None:
        raise AzureInputError(f"node {node!r} not found")
    spec = body.get("spec")
    provider_id = spec.get("providerID", "") if isinstance(spec, dict) else ""
    if not provider_id:
        raise AzureInputError(f"node {node!r} has no spec.providerID")
    return str(provider_id)


def _evict_node(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    from torchspot_lab.evict import NodeNotFoundError, evict_node  # noqa: PLC0415
    from torchspot_operator.kube import ApiError, LoginError  # noqa: PLC0415

    try:
        kube = _kube()
    except LoginError as exc:
        print(f"torchspot evict node: error: {exc}", file=sys.stderr)
        return 2
    if kube is None:
        print(f"torchspot evict node: error: no kubeconfig ({KUBECONFIG_HINT})", file=sys.stderr)
        return 2

    async def run() -> int:
        try:
            done = await evict_node(kube, args.name, hard=args.hard)
        except NodeNotFoundError as exc:
            print(f"torchspot evict node: error: {exc}", file=sys.stderr)
            return 2
        except ApiError as exc:
            print(f"torchspot evict node: error: the API refused: {exc}", file=sys.stderr)
            return 1
        finally:
            await kube.close()
        how = "at once (grace 0)" if args.hard else "with their grace period"
        print(f"node {done.node} cordoned; {len(done.deleted)} pod(s) deleted {how}")
        for name in done.deleted:
            print(f"  deleted {name}")
        for name in done.kept:
            print(f"  kept {name} (DaemonSet)")
        return 0

    return asyncio.run(run())


def _lab_run(args: argparse.Namespace) -> int:
    from torchspot_lab.sandbox import JobFileError, load_job, run_sandbox  # noqa: PLC0415 - heavy imports

    try:
        scenario = load_scenario(args.scenario) if args.scenario else Scenario()
        job = load_job(args.job, code=args.code)
    except (ScenarioError, JobFileError) as exc:
        print(f"torchspot lab run: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or DEFAULT_OUT / f"{job['metadata']['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
    started = time.monotonic()
    try:
        report = run_sandbox(
            args.job, scenario, out.resolve(), say=lambda line: print(line, flush=True), code=args.code
        )
    except JobFileError as exc:
        print(f"torchspot lab run: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(report.summary())
    print(f"run took {time.monotonic() - started:.1f} s; logs of every pod under {out.resolve() / 'pods'}")
    return 0 if report.phase == "Succeeded" else 1


def _data_prepare(args: argparse.Namespace) -> int:
    from torchspot_trainer.data.prepare import prepare  # noqa: PLC0415 - torch: only for this command

    started = time.monotonic()
    try:
        manifest = prepare(
            args.source, args.dest, short_side=args.short_side, shard_images=args.shard_images,
            quality=args.quality, workers=args.workers, say=lambda line: print(line, flush=True),
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        print(f"torchspot data prepare: error: {exc}", file=sys.stderr)
        return 2
    splits = manifest["splits"]
    assert isinstance(splits, dict)
    total = ", ".join(
        f"{split} {count['images']:,} images in {count['shards']:,} shards" for split, count in splits.items()
    )
    print(f"{args.dest}: {total}, in {time.monotonic() - started:.1f} s; train with --data {args.dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse and dispatch; the exit status is 0 when the job succeeded."""
    args = build_parser().parse_args(argv)
    if args.command == "lab" and args.lab_command == "run":
        return _lab_run(args)
    if args.command == "data":
        return _data_prepare(args)
    if args.command == "evict" and args.evict_command == "node":
        return _evict_node(args)
    if args.command in ("evict", "aks"):
        return _azure(args)
    return 2  # argparse requires a subcommand; unreachable


if __name__ == "__main__":
    sys.exit(main())
