"""The model and data both DDP examples train: an MLP classifying synthetic points."""

import torch

FEATURES, CLASSES, SAMPLES = 32, 4, 960


def synthetic_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SAMPLES points and the class a fixed random linear teacher gives each (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    return inputs, (inputs @ teacher).argmax(dim=1)


def build_model() -> torch.nn.Module:
    """A two-layer MLP, initialised alike on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
