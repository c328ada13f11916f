"""What runs in a worker pod: the `torchspot-run` launcher and the training program."""

ENV_PREFIX = "TORCHSPOT_"
"""Each trainer flag's default may come from TORCHSPOT_<FLAG> (the operator passes the job's
checkpoint settings so). Here, not in config.py, so the operator can import it without torch."""
NODE_FAULT_EXIT = 75
"""The exit code that says "this node cannot run the program" (its GPU refused, its driver is gone),
not "the program failed": a worker that exits with it is not restarted on the node; its agent leaves
the rendezvous and exits with it too, and the operator counts the pod as an eviction, not a failure,
and keeps its replacements off that node (verdicts.py). 75 is sysexits' EX_TEMPFAIL: try again,
elsewhere. Any program may use it (`sys.exit(75)`). Here so the operator reads it without torch."""
PROG = "torchspot-run"
"""The launcher's name, as its messages (and its forked workers' refusals) say it."""
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
"""torch's elastic agent (torchrun, torchspot-run) names the job's run in every worker's environment
with it: the rendezvous's etcd keys and the node's snapshot file are the run's. Here so both sides read
the one name."""
REPLICA_GROUP_ENV = f"{ENV_PREFIX}REPLICA_GROUP"
REPLICA_GROUP_SIZE_ENV = f"{ENV_PREFIX}REPLICA_GROUP_SIZE"
"""A worker pod's replica group and the job's group size in pods (an ElasticJob's replicaGroupSize, where
it is more than 1), as the operator passes them: what a sharded script builds its HSDP mesh on. Here so the
operator sets them without importing torch."""
SNAPSHOT_DIR_ENV = f"{ENV_PREFIX}SNAPSHOT_DIR"
"""Environment variable naming the folder of the node-local snapshots (recovery/snapshot.py; default:
the temp folder). Here so the sandbox's kubelet can set it without importing torch."""


def env_switch(value: str) -> bool | None:
    """An on/off flag's value from its TORCHSPOT_ variable: True, False (unset counts as off), or None
    for anything else. Pure; here so the launcher reads the trainer's switches as the trainer does
    (config.py) without importing it."""
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    return None


def takes_in_place(in_place: bool | None, *, sync_bn: bool) -> bool:
    """Whether our trainer, under torchspot-run's etcd-v3 agent, re-forms in place: asked (`--in-place`),
    or left unset without `--sync-bn` (whose SyncBatchNorm needs the default group in place has none
    of). Pure; here so the launcher decides as the trainer does (run.choose_in_place) without importing it."""
    return in_place is True or (in_place is None and not sync_bn)
