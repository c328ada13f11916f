"""torchspot: elastic PyTorch training on Kubernetes GPU spot node pools.

The import names map to the repository's top-level folders through symlinks in
this folder: `torchspot_operator` is `operator/` (the standard library owns the
bare name `operator`), `torchspot_trainer` is `trainer/`, `torchspot_lab` is `lab/`.
"""

__version__ = "0.1.0"
