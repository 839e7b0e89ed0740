"""Dataset loaders on tiny files written here in the standard MNIST (IDX) and CIFAR-10 (python) formats."""

import gzip
import pickle
import struct

import numpy as np
import pytest

from hetdp import ConfigError
from hetdp.bench.datasets import load_dataset


def write_idx(path, magic, array, compress=False):
    header = struct.pack(f">{1 + array.ndim}i", magic, *array.shape)
    opener = gzip.open if compress else open
    with opener(str(path) + (".gz" if compress else ""), "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def mnist_root(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, count, compress in (("train", 5, True), ("t10k", 3, False)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", 2051, rng.integers(0, 256, (count, 28, 28)), compress)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", 2049, np.arange(count) % 10, compress)
    return tmp_path


def test_mnist_loads_images_scaled_and_labels(mnist_root):
    split = load_dataset("mnist", mnist_root)
    images, labels = split.train.tensors
    assert images.shape == (5, 1, 28, 28) and 0.0 <= images.min() and images.max() <= 1.0
    assert labels.tolist() == [0, 1, 2, 3, 4] and len(split.test) == 3


def test_mnist_with_a_wrong_magic_number_names_the_file(mnist_root):
    write_idx(mnist_root / "t10k-labels-idx1-ubyte", 1234, np.arange(3))
    with pytest.raises(ConfigError, match="t10k-labels-idx1-ubyte is not an IDX file"):
        load_dataset("mnist", mnist_root)


def test_cifar10_loads_python_batches(tmp_path):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{n}" for n in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [1, 7]}
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    split = load_dataset("cifar10", tmp_path)
    assert split.train.tensors[0].shape == (10, 3, 32, 32) and split.image_shape == (3, 32, 32)
    assert split.test.tensors[1].tolist() == [1, 7]


def test_digits_needs_no_files_and_unknown_names_are_rejected():
    assert load_dataset("digits").image_shape == (1, 8, 8)
    with pytest.raises(ConfigError, match="dataset must be one of"):
        load_dataset("imagenet")
    with pytest.raises(ConfigError, match="needs --data-root"):
        load_dataset("mnist", None)
