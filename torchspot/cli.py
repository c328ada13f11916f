"""`torchspot`: the command line for the lab.

    torchspot lab run JOB.yaml [--scenario SCENARIO.yaml] [--out DIR]

runs an ElasticJob in the local sandbox (lab/sandbox.py) through a scripted spot
market (lab/scenario.py) and prints the report. A bad job or scenario file stops it
before anything starts, with a message that names the problem.

    torchspot evict node NAME [--hard]

rehearses a spot eviction on the cluster the kubeconfig points at (lab/evict.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from torchspot.lab.scenario import Scenario, ScenarioError, load_scenario

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("runs")


def build_parser() -> argparse.ArgumentParser:
    """The `torchspot` parser and its subcommands."""
    parser = argparse.ArgumentParser(prog="torchspot", description="Elastic PyTorch training on spot node pools.")
    commands = parser.add_subparsers(dest="command", required=True)
    lab = commands.add_parser("lab", help="the local sandbox").add_subparsers(dest="lab_command", required=True)
    run = lab.add_parser("run", help="run an ElasticJob in the local sandbox through a scripted spot market")
    run.add_argument("job", type=Path, help="an ElasticJob YAML file")
    run.add_argument("--scenario", type=Path, help="a scenario YAML file (default: 3 spot nodes, no events)")
    run.add_argument(
        "--out", type=Path, default=None, help="folder for logs and the report (default: runs/<job>-<time>)"
    )
    evict = commands.add_parser("evict", help="rehearse a spot eviction")
    kinds = evict.add_subparsers(dest="evict_command", required=True)
    node = kinds.add_parser("node", help="cordon a node and delete its pods with their grace period (any cluster)")
    node.add_argument("name", help="the node's name (kubectl get nodes)")
    node.add_argument("--hard", action="store_true", help="delete the pods at once (grace 0), as when a VM vanishes")
    return parser


def _evict_node(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415

    import kopf  # noqa: PLC0415

    from torchspot.lab.evict import NodeNotFoundError, evict_node  # noqa: PLC0415
    from torchspot.operator.kube import ApiError, Kube  # noqa: PLC0415

    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    if info is None:
        print("torchspot evict node: error: no kubeconfig (set KUBECONFIG or ~/.kube/config)", file=sys.stderr)
        return 2
    kube = Kube.from_connection(info)

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
    from torchspot.lab.sandbox import JobFileError, load_job, run_sandbox  # noqa: PLC0415 - heavy imports

    try:
        scenario = load_scenario(args.scenario) if args.scenario else Scenario()
        job = load_job(args.job)
    except (ScenarioError, JobFileError) as exc:
        print(f"torchspot lab run: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or DEFAULT_OUT / f"{job['metadata']['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
    started = time.monotonic()
    try:
        report = run_sandbox(args.job, scenario, out.resolve(), say=lambda line: print(line, flush=True))
    except JobFileError as exc:
        print(f"torchspot lab run: error: {exc}", file=sys.stderr)
        return 2
    print()
    print(report.summary())
    print(f"run took {time.monotonic() - started:.1f} s; logs of every pod under {out.resolve() / 'pods'}")
    return 0 if report.phase == "Succeeded" else 1


def main(argv: list[str] | None = None) -> int:
    """Parse and dispatch; the exit status is 0 when the job succeeded."""
    args = build_parser().parse_args(argv)
    if args.command == "lab" and args.lab_command == "run":
        return _lab_run(args)
    if args.command == "evict" and args.evict_command == "node":
        return _evict_node(args)
    return 2  # argparse requires a subcommand; unreachable


if __name__ == "__main__":
    sys.exit(main())
