"""Small reference models used by the demo, the examples and the benchmarks, and how they are scored."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class ConvNet(nn.Module):
    """The task-allocation paper's ConvNet: two conv + max-pool stages and one linear layer."""

    def __init__(self, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, batch_size: int = 1024) -> float:
    """Fraction of ``dataset`` that ``model`` classifies correctly (evaluated locally, no collective)."""
    model.eval()
    device = next(model.parameters()).device
    inputs, targets = dataset.tensors
    correct = 0
    for start in range(0, len(inputs), batch_size):
        logits = model(inputs[start : start + batch_size].to(device))
        correct += int((logits.argmax(1).cpu() == targets[start : start + batch_size]).sum())
    model.train()
    return correct / max(len(inputs), 1)
