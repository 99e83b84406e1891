"""Datasets for ``fastdp train``: Fashion-MNIST from local IDX files, scikit-learn's digits.

Nothing is downloaded at run time. Fashion-MNIST comes from the Debian package
``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``) or any directory
holding the four ``*-ubyte.gz`` (or uncompressed) IDX files.
"""
from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_INSTALL = "apt-get install dataset-fashion-mnist"
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
DATASETS = ("fashion-mnist", "digits")


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are not on this machine; the message says how to install them."""


class TensorPairs(Dataset):
    """In-memory ``(inputs, labels)`` tensors with batched indexing.

    ``__getitems__`` lets a DataLoader fetch a whole batch with one gather instead of one
    ``__getitem__`` per example; pair it with :func:`collate_pairs`.
    """

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor):
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]

    def __getitems__(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.inputs[idx], self.labels[idx]


def collate_pairs(batch):
    """Collate for :class:`TensorPairs`: a gathered batch passes through, a list of samples is stacked."""
    if isinstance(batch, tuple):
        return batch
    inputs, labels = zip(*batch)
    return torch.stack(inputs), torch.stack(labels)


@dataclass
class Splits:
    """Train and test sets, already normalised, plus the input shape and class count."""

    train: TensorPairs
    test: TensorPairs
    input_shape: Tuple[int, ...]
    num_classes: int


def _open_idx(directory: str, stem: str):
    for name, opener in ((stem + ".gz", gzip.open), (stem, open)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            try:
                with opener(path, "rb") as f:
                    return f.read(), path
            except (OSError, EOFError, zlib.error) as exc:  # a bad header, a truncated or a corrupt stream
                raise ValueError(f"{path}: not a readable IDX file ({exc}); reinstall or download it again") from None
    return None, os.path.join(directory, stem + ".gz")


def read_idx(data: bytes, path: str = "<bytes>") -> np.ndarray:
    """Decode an IDX file of unsigned bytes (magic ``0x0000 08 ndim``, big-endian dims)."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(dims)):
        raise ValueError(f"{path}: expected {int(np.prod(dims))} bytes of data for shape {dims}, "
                         f"found {len(data) - header}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load_fashion_mnist_arrays(data_dir: Optional[str] = None):
    """``{"train": (images uint8 (N, 28, 28), labels int64 (N,)), "test": ...}`` from IDX files."""
    directory = data_dir or FASHION_MNIST_DIR
    out = {}
    for split, (images_stem, labels_stem) in FASHION_MNIST_FILES.items():
        arrays = []
        for stem in (images_stem, labels_stem):
            data, path = _open_idx(directory, stem)
            if data is None:
                hint = (f"install it with `{FASHION_MNIST_INSTALL}`" if data_dir is None else
                        f"point --data-dir at a directory holding the Fashion-MNIST IDX files, or "
                        f"install them into {FASHION_MNIST_DIR} with `{FASHION_MNIST_INSTALL}`")
                raise DatasetNotFoundError(f"Fashion-MNIST file {path} not found: {hint}")
            arrays.append(read_idx(data, path))
        images, labels = arrays
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(f"Fashion-MNIST {split}: images {images.shape} do not match labels {labels.shape}")
        out[split] = (images, labels.astype(np.int64))
    return out


def _normalised(train_x: np.ndarray, test_x: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale to [0, 1] then standardise with the training set's mean and std (one scalar each).

    The statistics come from the private training data; two scalars of it are a negligible
    leak next to the model, and are what the published DP baselines do as well.
    """
    train = torch.from_numpy(np.ascontiguousarray(train_x, dtype=np.float32))
    test = torch.from_numpy(np.ascontiguousarray(test_x, dtype=np.float32))
    scale = float(max(train.max().item(), 1.0))
    mean, std = train.mean().item() / scale, train.std().item() / scale
    return (train / scale - mean) / std, (test / scale - mean) / std


def _subset(x: np.ndarray, y: np.ndarray, n: Optional[int], seed: int):
    if n is None or n == len(y):
        return x, y
    if not 0 < n < len(y):
        raise ValueError(f"--subset {n}: expected a number of training examples from 1 to {len(y)}")
    keep = np.sort(np.random.default_rng(seed).choice(len(y), size=n, replace=False))
    return x[keep], y[keep]


def load_dataset(name: str, data_dir: Optional[str] = None, subset: Optional[int] = None,
                 seed: int = 0) -> Splits:
    """Load ``name`` ("fashion-mnist" or "digits") as normalised ``(N, 1, H, W)`` float tensors.

    ``subset`` keeps that many training examples (drawn with ``seed``); the test set is whole.
    """
    if name == "fashion-mnist":
        arrays = load_fashion_mnist_arrays(data_dir)
        (train_x, train_y), (test_x, test_y) = arrays["train"], arrays["test"]
    elif name == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise ImportError("--dataset digits needs scikit-learn: pip install scikit-learn "
                              "(or pip install 'fastdp[data]')") from None
        digits = load_digits()
        x, y = digits.images.astype(np.float32), digits.target.astype(np.int64)
        order = np.random.default_rng(12345).permutation(len(y))  # fixed split, any --seed
        n_test = len(y) // 5
        test_idx, train_idx = order[:n_test], order[n_test:]
        train_x, train_y, test_x, test_y = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    else:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    train_x, train_y = _subset(train_x, train_y, subset, seed)
    train_t, test_t = _normalised(train_x, test_x)
    train_t, test_t = train_t.unsqueeze(1), test_t.unsqueeze(1)
    return Splits(
        train=TensorPairs(train_t, torch.from_numpy(np.ascontiguousarray(train_y))),
        test=TensorPairs(test_t, torch.from_numpy(np.ascontiguousarray(test_y))),
        input_shape=tuple(train_t.shape[1:]),
        num_classes=int(max(train_y.max(), test_y.max())) + 1,
    )
