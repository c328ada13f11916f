"""ResNets written here (there is no CPU build of torchvision on our machines).

- `resnet18` is the CIFAR variant: a 3x3 stem with stride 1 and no max-pool, so
  32x32 images keep enough resolution (He et al. 2016, section 4.2 style).
- `resnet50` is the ImageNet model: 7x7 stride-2 stem, max-pool, bottleneck blocks
  [3, 4, 6, 3]; about 25.6 M parameters, the same shapes as torchvision's.
- `small_cnn` is a two-layer network for 8x8 digit images (tests, quick runs), or any other
  data set's images where the model's cost should not count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual forward pass."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand, with a shortcut (ResNet-50 and deeper)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual forward pass."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet body over `blocks` per stage, with a CIFAR or an ImageNet stem."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        blocks: list[int],
        num_classes: int,
        *,
        cifar_stem: bool,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.in_planes = 64
        if cifar_stem:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        stages = []
        for index, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            stride = 1 if index == 0 else 2
            layers = []
            for block_stride in [stride] + [1] * (count - 1):
                layers.append(block(self.in_planes, planes, block_stride))
                self.in_planes = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.in_planes, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of NCHW images."""
        logits: torch.Tensor = self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))
        return logits


def resnet18(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """ResNet-18 with the CIFAR stem (32x32 inputs)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, cifar_stem=True, in_channels=in_channels)


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet-50 for ImageNet-sized inputs (224x224)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, cifar_stem=False, in_channels=in_channels)


class SmallCNN(nn.Module):
    """Two convolutions and a linear layer; for 8x8 digits and fast tests."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )  # fmt: skip
        self.fc = nn.Linear(32 * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        logits: torch.Tensor = self.fc(torch.flatten(self.features(x), 1))
        return logits


MODELS: dict[str, Callable[[int, int], nn.Module]] = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "small_cnn": SmallCNN,
}
"""`--model` choices, each built from the classes and the image channels of the data set."""
