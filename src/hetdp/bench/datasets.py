"""Datasets the demo, examples and benchmarks train on, as in-memory tensors.

The default is scikit-learn's bundled digits (no download, 1,797 8x8 images).
MNIST and CIFAR-10 are read from local files in their standard formats.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch
from torch.utils.data import TensorDataset

from hetdp.errors import ConfigError


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


def load_mnist(root: str | Path) -> Split:
    """MNIST from its four IDX files in ``root`` (gzipped or not), as 1 x 28 x 28 images in [0, 1]."""
    root = Path(root)
    train = _idx_images(root, "train-images-idx3-ubyte"), _idx_labels(root, "train-labels-idx1-ubyte")
    test = _idx_images(root, "t10k-images-idx3-ubyte"), _idx_labels(root, "t10k-labels-idx1-ubyte")
    return _fixed_split(train, test, num_classes=10)


def load_cifar10(root: str | Path) -> Split:
    """CIFAR-10 from the python-format batches in ``root`` (the cifar-10-batches-py folder), as 3 x 32 x 32 in [0, 1].

    The batches are pickles: load only files from a source you trust.
    """
    root = Path(root)
    train_parts = [_cifar_batch(root / f"data_batch_{number}") for number in range(1, 6)]
    train = np.concatenate([images for images, _ in train_parts]), np.concatenate([labels for _, labels in train_parts])
    return _fixed_split(train, _cifar_batch(root / "test_batch"), num_classes=10)


DATASETS = {"digits": load_digits, "mnist": load_mnist, "cifar10": load_cifar10}
"""Dataset name -> loader; every loader but digits takes the folder of its files."""


def load_dataset(name: str, root: str | Path | None = None, seed: int = 0) -> Split:
    """Load ``name`` (digits, mnist or cifar10); ``root`` is the folder of the files, unused for digits.

    Raises:
        ConfigError: unknown name, missing folder, or files not in the standard format.
    """
    if name not in DATASETS:
        raise ConfigError(f"dataset must be one of {', '.join(DATASETS)}, got {name!r}")
    if name == "digits":
        return load_digits(seed=seed)
    if root is None or not Path(root).is_dir():
        raise ConfigError(f"dataset {name} needs --data-root, the folder of its files; got {root}")
    return DATASETS[name](root)


def _open(root: Path, stem: str) -> IO[bytes]:
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return gzip.open(candidate) if candidate.suffix == ".gz" else candidate.open("rb")
    raise ConfigError(f"MNIST file {stem}[.gz] not found in {root}")


def _idx_header(handle: IO[bytes], stem: str, magic: int, dimensions: int) -> tuple[int, ...]:
    header = handle.read(4 * (1 + dimensions))
    values = struct.unpack(f">{1 + dimensions}i", header) if len(header) == 4 * (1 + dimensions) else (0,)
    if values[0] != magic:
        raise ConfigError(f"{stem} is not an IDX file (magic number {values[0]}, expected {magic})")
    return values[1:]


def _idx_images(root: Path, stem: str) -> np.ndarray:
    with _open(root, stem) as handle:
        count, rows, columns = _idx_header(handle, stem, 2051, 3)
        pixels = np.frombuffer(handle.read(), dtype=np.uint8)
    if pixels.size != count * rows * columns:
        raise ConfigError(f"{stem} holds {pixels.size} pixels, its header promises {count} x {rows} x {columns}")
    return pixels.reshape(count, 1, rows, columns).astype(np.float32) / 255.0


def _idx_labels(root: Path, stem: str) -> np.ndarray:
    with _open(root, stem) as handle:
        (count,) = _idx_header(handle, stem, 2049, 1)
        labels = np.frombuffer(handle.read(), dtype=np.uint8)
    if labels.size != count:
        raise ConfigError(f"{stem} holds {labels.size} labels, its header promises {count}")
    return labels.astype(np.int64)


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise ConfigError(f"CIFAR-10 batch {path.name} not found in {path.parent}")
    with path.open("rb") as handle:
        try:
            batch = pickle.load(handle, encoding="bytes")
            data, labels = batch[b"data"], batch[b"labels"]
        except (pickle.UnpicklingError, EOFError, KeyError, TypeError) as error:
            raise ConfigError(f"{path} is not a CIFAR-10 python batch: {error}") from error
    images = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    return images, np.asarray(labels, dtype=np.int64)


def _fixed_split(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], num_classes: int) -> Split:
    def tensors(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
        if len(images) != len(labels):
            raise ConfigError(f"{len(images)} images but {len(labels)} labels")
        return TensorDataset(torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels))

    return Split(tensors(*train), tensors(*test), num_classes)
