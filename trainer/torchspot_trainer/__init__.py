"""What runs in a worker pod: the `torchspot-run` launcher and the training program."""

ENV_PREFIX = "TORCHSPOT_"
"""Each trainer flag's default may come from TORCHSPOT_<FLAG> (the operator passes the job's
checkpoint settings so). Here, not in config.py, so the operator can import it without torch."""
SNAPSHOT_DIR_ENV = f"{ENV_PREFIX}SNAPSHOT_DIR"
"""Environment variable naming the folder of the node-local snapshots (recovery/snapshot.py; default:
the temp folder). Here so the sandbox's kubelet can set it without importing torch."""
