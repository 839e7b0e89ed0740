"""Datasets the demo, examples and benchmarks train on, as in-memory tensors.

The default is scikit-learn's bundled digits (no download, 1,797 8x8 images).
MNIST and CIFAR-10 are read from local files in their standard formats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class Split:
    """A train/test pair of datasets of (image, label) with images as float32 N x C x H x W."""

    train: TensorDataset
    test: TensorDataset
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train.tensors[0].shape[1:])


def _tensor_split(images: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int, num_classes: int) -> Split:
    order = np.random.default_rng(seed).permutation(len(images))
    cut = len(images) - int(round(test_fraction * len(images)))
    x = torch.from_numpy(np.ascontiguousarray(images[order], dtype=np.float32))
    y = torch.from_numpy(labels[order].astype(np.int64))
    return Split(TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:]), num_classes)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's digits as 1 x 8 x 8 images scaled to [0, 1], shuffled and split with ``seed``."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = (bunch.images / 16.0).reshape(-1, 1, 8, 8)
    return _tensor_split(images, bunch.target, test_fraction, seed, num_classes=10)
