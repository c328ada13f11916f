"""The float32 reduction-order error of a fixed global batch: one configuration on 1, 2 and 3 nodes,
and what per-worker batches change instead.

With `--global-batch-size` the same run computes the same model at any world size, up
to the order in which sums are added (per-worker partial sums, the all-reduce). This
measures that order's effect when every step is affected: the configuration of
tests/trainer/test_training.py (digits, small_cnn, 48 samples per step, 8 epochs, real
agents, etcd and Azurite) on a group that never changes, at 1, 2 and 3 nodes. The
largest parameter difference and the largest relative difference between the losses
logged for one step, against the 3-node run, are what that test's tolerance is set from.

The control (what the tolerance must tell apart): the same run with `--batch-size 24` per worker
(no learning-rate scaling) on 2 nodes, one of them lost hard after 25 steps, so the group's batch
halves with the world as in other elastic systems; its distance from the 1-node fixed run is what a
runtime that let the world size change the optimisation would show.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for the test's configuration
from bench import record
from tests.trainer.test_training import EPOCHS, GLOBAL_BATCH, SAME_MODEL, TOLERANCE, largest_difference
from torchspot_lab.azurite import Azurite
from torchspot_lab.etcd import EtcdServer
from torchspot_lab.local import JobConfig, LocalNode, read_events, wait_for
from torchspot_trainer.checkpoint.manager import CheckpointConfig, CheckpointManager
from torchspot_trainer.checkpoint.storage import open_storage

PROGRAM = ["-m", "torchspot_trainer", *SAME_MODEL, "--epochs", str(EPOCHS), "--checkpoint-every", "10", "--no-in-place"]
"""tests/trainer/test_training.py's configuration (without its eviction settings)."""


CONTROL = "control"
"""The control run's name (module docstring)."""
CONTROL_LOSS_AT = 25
"""The control's step at which one of its two nodes is lost hard."""


def _run(
    root: Path, etcd: EtcdServer, blob: Azurite, nodes: int, *, control: bool = False
) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Train on `nodes` fixed nodes (the control: 2 nodes with per-worker batches, one lost at
    CONTROL_LOSS_AT); the final parameters and each step's logged loss."""
    name = CONTROL if control else f"fixed-{nodes}"
    workdir = root / name
    events = workdir / "train-events.jsonl"
    uri = f"az://ckpt/{name}"
    program = [*PROGRAM, "--checkpoint-uri", uri, "--events-file", str(events)]
    if control:
        program += ["--global-batch-size", "0", "--batch-size", str(GLOBAL_BATCH // 2)]
    job = JobConfig(
        workdir=workdir, backend="etcd-v3", endpoint=etcd.endpoint, run_id=f"equivalence-{name}",
        nnodes=f"1:{nodes}" if control else f"{nodes}:{nodes}", extra_env=blob.env(), program=program,
    )  # fmt: skip
    started = time.monotonic()
    group = [LocalNode(f"n{i}", job) for i in range(nodes)]
    for node in group:
        node.start()
    if control:

        def reached() -> bool:
            return any(e.get("event") == "progress" and e["step"] >= CONTROL_LOSS_AT for e in read_events(events))

        wait_for(reached, 300, f"{CONTROL_LOSS_AT} steps")
        group.pop().kill()
    codes = [node.wait(600) for node in group]
    if codes != [0] * len(group):
        raise SystemExit(f"{name}: exit codes {codes}; see {workdir}")
    print(f"  {name}: {time.monotonic() - started:.0f} s", flush=True)
    loaded = CheckpointManager(open_storage(uri, blob.env()), CheckpointConfig()).load_latest()
    assert loaded is not None
    losses = {e["step"]: e["loss"] for e in read_events(events) if e.get("event") == "progress"}
    return {name: t.double() for name, t in loaded.state["user"]["model"].items()}, losses  # (the trainer's part)


def main() -> None:
    """Run the configuration on 3, 2 and 1 nodes and print the differences from the 3-node run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="the results (default: bench/results/equivalence/...)")
    args = parser.parse_args()
    recording = record.Run("equivalence", args.out)
    with tempfile.TemporaryDirectory(prefix="torchspot-equivalence-") as tmp:
        root = Path(tmp)
        with EtcdServer(root / "etcd") as etcd, Azurite(root / "azurite") as blob:
            runs = {nodes: _run(root, etcd, blob, nodes) for nodes in (3, 2, 1)}
            control, _ = _run(root, etcd, blob, 2, control=True)
    reference, reference_losses = runs[3]
    largest = max(float(t.abs().max()) for t in reference.values())
    rows = []
    with recording.captured():
        print(f"\nAgainst the 3-node run (largest parameter {largest:.2f}):")
        for nodes in (2, 1):
            params, losses = runs[nodes]
            if sorted(losses) != sorted(reference_losses):
                raise SystemExit(f"{nodes} nodes logged other steps than 3 nodes")
            difference = largest_difference(reference, params)
            loss = max(abs(losses[s] - reference_losses[s]) / reference_losses[s] for s in reference_losses)
            rows.append({"nodes": nodes, "parameter_difference": difference, "relative_loss_difference": loss})
            print(f"  {nodes} node(s): largest parameter difference {difference:.2g}, "
                  f"largest relative loss difference {loss:.2g} over {len(losses)} steps")  # fmt: skip
        one_node = runs[1][0]
        diverged = largest_difference(one_node, control)
        print(f"\nThe control (per-worker batches of {GLOBAL_BATCH // 2}, 2 nodes, one lost at step {CONTROL_LOSS_AT}) "
              f"against the 1-node run: largest parameter difference {diverged:.2g}, {diverged / TOLERANCE:.0f} times "
              f"the same-model test's bound ({TOLERANCE:g})")  # fmt: skip
        summary = {"largest_parameter": largest, "against_3_nodes": rows, "control_against_1_node": diverged}
    recording.write(rows, figures=summary)


if __name__ == "__main__":
    main()
