"""What runs in a worker pod: the `torchspot-run` launcher and the training program."""
