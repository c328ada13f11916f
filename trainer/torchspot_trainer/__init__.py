"""What runs in a worker pod: the `torchspot-run` launcher and the training program."""

ENV_PREFIX = "TORCHSPOT_"
"""Each trainer flag's default may come from TORCHSPOT_<FLAG> (the operator passes the job's
checkpoint settings so). Here, not in config.py, so the operator can import it without torch."""
