"""torchspot: elastic PyTorch training on Kubernetes GPU spot node pools.

This package is the `torchspot` command (cli.py). The operator, the trainer and the lab are
the packages `torchspot_operator`, `torchspot_trainer` and `torchspot_lab`, each in the
top-level folder of the same purpose (`operator/`, `trainer/`, `lab/`).
"""

__version__ = "0.1.0"
