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


class Block(nn.Module):
    """One block of ``TinyLM``: pre-norm self-attention and MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """The reference FSDP2 script's model (../shared/adoption/plain_fsdp2.py): a small causal transformer LM, sharded
    unit by unit (each block, then the root)."""

    def __init__(self, vocab: int = 64, width: int = 64, heads: int = 4, layers: int = 4, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def token_sequences(count: int, context: int = 32, vocab: int = 64, seed: int = 0) -> TensorDataset:
    """Arithmetic progressions modulo the vocabulary, each with its own start and stride (the reference script's
    data): ``context + 1`` tokens each, learnable in context."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    stride = torch.randint(1, 8, (count, 1), generator=generator)
    return TensorDataset((start + stride * torch.arange(context + 1)) % vocab)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``TinyLM``'s loss, as the reference script computes it: each token predicted from those before it."""
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
