"""Small datasets for the examples and tests: in memory, deterministic (drawn from the ``seed``
argument, never the global RNG, so every rank builds the same), never downloaded at run time."""

from __future__ import annotations

import gzip
import importlib.util
import math
import struct
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the MNIST training pixels scaled to [0, 1]

_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# IDX magic numbers: unsigned bytes, 3 dimensions / 1 dimension
_IDX_IMAGES, _IDX_LABELS = 2051, 2049


class DemoDataset(TensorDataset):
    """A ``TensorDataset`` whose fingerprint holds its content: the same sizes drawn another way are
    different data to a resume."""

    def fingerprint(self) -> dict[str, str]:
        """A hash of the tensors' bytes, each hashed where it lies."""
        from ddpkit.data._fingerprint import digest

        parts = "".join(digest(t.contiguous().reshape(-1).numpy().data) for t in self.tensors)
        shapes = ", ".join("x".join(map(str, t.shape)) for t in self.tensors)
        return {"dataset": f"{len(self)} samples ({shapes}), content {digest(parts.encode())}"}


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: use 'train' or 'test'")


def digits(split: str, seed: int = 0, test_fraction: float = 0.2) -> TensorDataset:
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images of 0-9, float32 ``(1, 8, 8)``
    normalised with the train split's statistics, int64 labels. The split is stratified by class and
    a function of ``(seed, test_fraction)`` alone (360 test samples by default)."""
    _check_split(split)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction}: must be between 0 and 1")
    pixels, labels = _bundled_digits()
    images = (pixels / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)  # pixel values are 0..16
    train_idx, test_idx = _stratified_split(labels, test_fraction, seed)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    idx = train_idx if split == "train" else test_idx
    x = (images[idx] - mean) / std
    return DemoDataset(torch.from_numpy(x), torch.from_numpy(labels[idx]))


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (float64, 0..16) and labels (int64), as ``load_digits`` gives them: read
    from scikit-learn's own file without importing scikit-learn (~2 s), else by ``load_digits``."""
    missing = (
        "ddpkit.demo.digits needs scikit-learn, which bundles the digits: pip install "
        "'ddpkit[examples]'"
    )
    try:
        spec = importlib.util.find_spec("sklearn")  # finds the package; runs none of it
    except ValueError:  # a module object without a spec stands for it
        spec = None
    if spec is None:
        raise ImportError(missing)
    for folder in spec.submodule_search_locations or ():
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")  # 64 pixels, then the label, per row
            return table[:, :-1], table[:, -1].astype(np.int64)
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(f"{missing} ({err})") from err
    bunch = load_digits()
    return bunch.data, bunch.target.astype(np.int64)


def _stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices in increasing order: ``ceil(test_fraction x n)`` test samples, each
    class giving its share rounded down, the rest one each to the classes rounding cut most (ties
    in a seeded order); which of a class's samples go to test is a seeded draw."""
    rng = np.random.default_rng(seed)
    n_test = math.ceil(test_fraction * len(labels))
    classes, counts = np.unique(labels, return_counts=True)
    if not len(classes) <= n_test <= len(labels) - len(classes):
        raise ValueError(
            f"test_fraction={test_fraction} gives {n_test} of {len(labels)} samples to test: each "
            f"split needs at least one sample of each of the {len(classes)} classes; take a "
            f"fraction between {len(classes) / len(labels):.4f} and "
            f"{1 - len(classes) / len(labels):.4f}"
        )
    share = counts * (n_test / len(labels))
    take = np.floor(share).astype(np.int64)
    cut = share - take
    order = np.lexsort((rng.permutation(len(classes)), -cut))
    take[order[: n_test - int(take.sum())]] += 1
    test = np.zeros(len(labels), dtype=bool)
    for label, k in zip(classes, take):
        members = np.flatnonzero(labels == label)
        test[rng.choice(members, size=int(k), replace=False)] = True
    return np.flatnonzero(~test), np.flatnonzero(test)


def _read_idx(path: Path, magic: int) -> np.ndarray:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    ndim = 3 if magic == _IDX_IMAGES else 1
    header = 4 * (1 + ndim)
    if len(data) < header:
        raise ValueError(
            f"{path}: {len(data)} bytes is too short for an IDX header; the file is truncated"
        )
    found, *shape = struct.unpack(f">{1 + ndim}I", data[:header])
    if found != magic:
        kind = "images" if magic == _IDX_IMAGES else "labels"
        raise ValueError(
            f"{path}: magic number {found}, expected {magic} for MNIST {kind}; is it the right "
            "file, and decompressed if its name does not end in .gz?"
        )
    expected = int(np.prod(shape))
    if len(data) - header != expected:
        raise ValueError(
            f"{path}: {len(data) - header} bytes of data, expected {expected} for shape "
            f"{tuple(shape)}; the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _find(root: Path, name: str) -> Path | None:
    for folder in (root, root / "MNIST" / "raw"):
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def mnist(root: str, split: str) -> TensorDataset:
    """MNIST from the four standard IDX files in ``root`` or its ``MNIST/raw`` (raw or ``.gz``):
    float32 ``(N, 1, 28, 28)`` normalised with MNIST's usual mean and std, int64 labels. Nothing is
    downloaded."""
    _check_split(split)
    folder = Path(root).expanduser()
    names = _MNIST_FILES[split]
    found = [_find(folder, name) for name in names]
    paths = [path for path in found if path is not None]
    missing = [name for name, path in zip(names, found) if path is None]
    if missing:
        every = ", ".join(name for pair in _MNIST_FILES.values() for name in pair)
        raise FileNotFoundError(
            f"MNIST {split} data not found in {folder.resolve()} (nor in its MNIST/raw): missing "
            f"{', '.join(missing)} (raw or .gz). Nothing is downloaded at run time: put the MNIST "
            f"IDX files ({every}) in that folder first."
        )
    images = _read_idx(paths[0], _IDX_IMAGES)
    labels = _read_idx(paths[1], _IDX_LABELS)
    if len(images) != len(labels):
        raise ValueError(
            f"{paths[0]} holds {len(images)} images but {paths[1]} holds {len(labels)} labels"
        )
    x = (torch.from_numpy(images.astype(np.float32) / 255.0) - MNIST_MEAN) / MNIST_STD
    return DemoDataset(x.unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))


def toy_regression(size: int = 2048, in_features: int = 20, seed: int = 0) -> TensorDataset:
    """``size`` samples ``(x, y)`` with ``y = x @ w + b + noise``: ``x`` standard normal, ``w`` and
    ``b`` fixed by ``seed`` (the same for every ``size``), noise of std 0.1 (best MSE about
    0.01)."""
    if size < 1 or in_features < 1:
        raise ValueError(f"size={size}, in_features={in_features}: both must be >= 1")
    g = torch.Generator().manual_seed(seed)
    # w first, so the map does not depend on size; y's variance near 1
    w = torch.randn(in_features, 1, generator=g) / in_features**0.5
    b = torch.randn(1, generator=g)
    x = torch.randn(size, in_features, generator=g)
    y = x @ w + b + 0.1 * torch.randn(size, 1, generator=g)
    return DemoDataset(x, y)


CHARS = "\n" + "".join(map(chr, range(32, 127)))
"""The character vocabulary of :func:`python_source`: newline and printable ASCII; anything else
reads as ``?``."""
IGNORE_INDEX = -100
"""The label of a padding position (``F.cross_entropy``'s default ``ignore_index``)."""
_CODES = {c: i for i, c in enumerate(CHARS)}


def encode(text: str) -> torch.Tensor:
    unknown = _CODES["?"]
    return torch.tensor([_CODES.get(c, unknown) for c in text], dtype=torch.long)


def decode(tokens: Iterable[int]) -> str:
    return "".join(CHARS[int(t)] for t in tokens)


def python_source(split: str, block_size: int = 64, max_chars: int = 400_000) -> TensorDataset:
    """Character-level next-token samples ``(tokens [T], labels [T])`` from the standard library's
    top-level ``*.py`` files in name order (every tenth in ``test``), up to ``max_chars`` a split,
    ``T = block_size``; a document's last window is padded with labels :data:`IGNORE_INDEX`."""
    _check_split(split)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    picked = [f for k, f in enumerate(files) if (k % 10 == 9) == (split == "test")]
    xs, ys, used = [], [], 0
    for path in picked:
        doc = encode(path.read_text(encoding="utf-8", errors="replace")[: max_chars - used])
        used += len(doc)
        for start in range(0, len(doc) - 1, block_size):
            window = doc[start : start + block_size + 1]
            x = torch.zeros(block_size, dtype=torch.long)
            y = torch.full((block_size,), IGNORE_INDEX, dtype=torch.long)
            x[: len(window) - 1], y[: len(window) - 1] = window[:-1], window[1:]
            xs.append(x)
            ys.append(y)
        if used >= max_chars:
            break
    return DemoDataset(torch.stack(xs), torch.stack(ys))
