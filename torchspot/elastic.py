"""The recovery API for your own training loop (torchspot_trainer.elastic, under its public name).

    import torchspot.elastic as elastic

    manager = elastic.Manager(state_dict=..., load_state_dict=..., checkpoint_uri="az://ckpt/run")
    model = elastic.DistributedDataParallel(manager, model)
    optimizer = elastic.OptimizerWrapper(manager, optimizer)
    sampler = elastic.ElasticSampler(manager, len(dataset), global_batch=64)
    scaler = elastic.GradScaler(manager, "cuda")  # float16 only: bfloat16 needs no scaler

The docs' "Bring your own script" guide shows a whole loop.
"""

from torchspot_trainer.elastic import (
    ApiOrderError,
    DistributedDataParallel,
    ElasticSampler,
    GradScaler,
    Manager,
    OptimizerWrapper,
    Refused,
)

__all__ = [
    "ApiOrderError",
    "DistributedDataParallel",
    "ElasticSampler",
    "GradScaler",
    "Manager",
    "OptimizerWrapper",
    "Refused",
]
