"""ddpkit.demo._datasets: the examples' data, built identically on every rank and never
downloaded."""

import gzip
import importlib.machinery
import importlib.util
import struct
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit.demo import _datasets
from ddpkit.demo._datasets import MNIST_MEAN, MNIST_STD, digits, mnist, toy_regression

# --- digits ---------------------------------------------------------------------------------------


def _raw_rows(split_x: torch.Tensor, scale: float, shift: float) -> list[bytes]:
    # Undo the normalisation back to the bundled integer pixels (0..16), one hashable row per image.
    pixels = torch.round((split_x * scale + shift) * 16).to(torch.uint8)
    return [row.numpy().tobytes() for row in pixels.reshape(len(pixels), -1)]


def test_digits_split_sizes_dtypes_and_shapes():
    train, test = digits("train"), digits("test")
    assert (len(train), len(test)) == (1437, 360)  # 1,797 images, a fifth held out (rounded up)
    for ds in (train, test):
        x, y = ds.tensors
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8)
        assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))


def test_digits_train_and_test_partition_the_whole_set():
    from sklearn.datasets import load_digits

    train, test = digits("train"), digits("test")
    xt = train.tensors[0]
    # Both splits share one affine normalisation; pixels 0 and 16 occur in train, so its extremes
    # fix it.
    scale = 1.0 / float(xt.max() - xt.min())
    shift = -float(xt.min()) * scale
    bunch = load_digits()
    whole = Counter(zip((r.astype(np.uint8).tobytes() for r in bunch.data), bunch.target.tolist()))
    train_rows = Counter(zip(_raw_rows(xt, scale, shift), train.tensors[1].tolist()))
    test_rows = Counter(zip(_raw_rows(test.tensors[0], scale, shift), test.tensors[1].tolist()))
    # Multisets add up to the whole set exactly: no sample is in both splits, none is lost or made
    # up.
    assert train_rows + test_rows == whole


def test_digits_split_is_stratified():
    full = Counter(digits("train").tensors[1].tolist()) + Counter(
        digits("test").tensors[1].tolist()
    )
    test = Counter(digits("test").tensors[1].tolist())
    for label, n in full.items():
        assert abs(test[label] - 0.2 * n) <= 1, (label, test[label], n)


def test_digits_is_deterministic_given_the_seed():
    a, b = digits("test", seed=3), digits("test", seed=3)
    assert all(torch.equal(u, v) for u, v in zip(a.tensors, b.tensors))
    other = digits("test", seed=4)
    # control: the seed does choose the split
    assert not torch.equal(a.tensors[0], other.tensors[0])


def test_digits_normalised_with_train_statistics():
    x_train, x_test = digits("train").tensors[0], digits("test").tensors[0]
    assert abs(float(x_train.mean())) < 1e-5
    assert abs(float(x_train.std(unbiased=False)) - 1.0) < 1e-5
    # The test split uses the train statistics, not its own: close to, but not exactly, 0 and 1.
    assert abs(float(x_test.mean())) < 0.1 and float(x_test.mean()) != pytest.approx(0.0, abs=1e-5)


def test_digits_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'train' or 'test'"):
        digits("val")
    with pytest.raises(ValueError, match="test_fraction"):
        digits("train", test_fraction=1.5)
    # Splits that would leave a class out of one of them (1,797 samples, 10 classes)
    for fraction in (0.001, 0.995):
        with pytest.raises(ValueError, match="at least one sample of each of the 10 classes"):
            digits("test", test_fraction=fraction)
    # Control: the extremes that keep every class in both splits
    for fraction, n_test in ((0.0056, 11), (0.994, 1787)):
        test = digits("test", test_fraction=fraction)
        train = digits("train", test_fraction=fraction)
        assert len(test) == n_test and len(train) == 1797 - n_test
        assert set(test.tensors[1].tolist()) == set(train.tensors[1].tolist()) == set(range(10))


def test_digits_without_sklearn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if not installed: found by no import
    with pytest.raises(ImportError, match=r"pip install 'ddpkit\[examples\]'"):
        digits("train")


@pytest.mark.heavy
def test_digits_are_read_without_importing_sklearn_and_as_load_digits_gives_them(monkeypatch):
    """Every rank of a digits job reads them: scikit-learn's import (~2 s, SciPy's statistics
    with it) is not paid for a 500 kB file."""
    code = (
        "import sys; from ddpkit.demo import digits; digits('train'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels, labels = _datasets._bundled_digits()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)
    assert labels.dtype == np.int64 and pixels.dtype == bunch.data.dtype
    # Control, and the fallback: where the file is not at its usual place, load_digits reads it.
    real_find_spec = importlib.util.find_spec
    elsewhere = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    elsewhere.submodule_search_locations = ["/nonexistent-sklearn"]
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: elsewhere if name == "sklearn" else real_find_spec(name, *a),
    )
    import sklearn.datasets

    calls = []
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda: calls.append(1) or load_digits())
    fallback = _datasets._bundled_digits()
    assert calls == [1]
    assert np.array_equal(fallback[0], pixels) and np.array_equal(fallback[1], labels)


# --- mnist ----------------------------------------------------------------------------------------


def _write_idx(path, array: np.ndarray, magic: int, compress: bool = False, cut: int = 0) -> None:
    data = (
        struct.pack(f">{1 + array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()
    )
    data = data[: len(data) - cut]
    if compress:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def _write_mnist(folder, split="train", n=5, side=4, compress=False, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, side, side), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    prefix = "train" if split == "train" else "t10k"
    _write_idx(folder / f"{prefix}-images-idx3-ubyte", images, 2051, compress)
    _write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, 2049, compress)
    return images, labels


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_mnist_round_trip(tmp_path, split, compress):
    images, labels = _write_mnist(tmp_path, split, compress=compress)
    x, y = mnist(str(tmp_path), split).tensors
    assert x.dtype == torch.float32 and x.shape == (5, 1, 4, 4)
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    expected = (torch.from_numpy(images).float() / 255 - MNIST_MEAN) / MNIST_STD
    torch.testing.assert_close(x[:, 0], expected)


def test_mnist_reads_torchvisions_layout(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _, labels = _write_mnist(raw, "test", compress=True)
    assert mnist(str(tmp_path), "test").tensors[1].tolist() == labels.tolist()


def test_mnist_missing_file_names_directory_and_files(tmp_path):
    _write_mnist(tmp_path, "train")
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError) as info:
        mnist(str(tmp_path), "train")
    message = str(info.value)
    assert str(tmp_path) in message
    assert "missing train-labels-idx1-ubyte" in message
    assert "train-images-idx3-ubyte" in message and "downloaded" in message


def test_mnist_empty_directory_lists_every_missing_file(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="missing t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte "
    ):
        mnist(str(tmp_path), "test")


def test_mnist_bad_magic_number(tmp_path):
    _write_mnist(tmp_path, "train")
    # A labels file where the images should be: the classic mix-up.
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((5, 4, 4)), 2049)
    with pytest.raises(ValueError, match="magic number 2049, expected 2051 for MNIST images"):
        mnist(str(tmp_path), "train")


def test_mnist_truncated_file(tmp_path):
    _write_mnist(tmp_path, "train")
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((5, 4, 4)), 2051, cut=3)
    with pytest.raises(ValueError, match="77 bytes of data, expected 80.*truncated"):
        mnist(str(tmp_path), "train")


def test_mnist_images_and_labels_must_agree(tmp_path):
    _write_mnist(tmp_path, "train", n=5)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4), 2049)
    with pytest.raises(ValueError, match="5 images but .* 4 labels"):
        mnist(str(tmp_path), "train")


def test_mnist_rejects_unknown_split(tmp_path):
    with pytest.raises(ValueError, match="'train' or 'test'"):
        mnist(str(tmp_path), "validation")


# --- toy_regression -------------------------------------------------------------------------------


def test_toy_regression_is_deterministic_given_the_seed():
    a, b = toy_regression(seed=1), toy_regression(seed=1)
    assert all(torch.equal(u, v) for u, v in zip(a.tensors, b.tensors))
    assert not torch.equal(a.tensors[1], toy_regression(seed=2).tensors[1])


def test_toy_regression_shapes():
    x, y = toy_regression(size=100, in_features=7).tensors
    assert x.shape == (100, 7) and y.shape == (100, 1)
    assert x.dtype == y.dtype == torch.float32


def _least_squares(size: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    x, y = toy_regression(size=size, seed=seed).tensors
    design = torch.cat([x, torch.ones(len(x), 1)], dim=1).double()
    coef = torch.linalg.lstsq(design, y.double()).solution
    return coef, float((design @ coef - y.double()).pow(2).mean())


def test_toy_regression_is_learnable_by_a_linear_model():
    coef, mse = _least_squares(4096)
    assert 0.008 < mse < 0.012  # the noise floor, 0.1 ** 2: unlike the DDP tutorials' pure noise
    # The map depends on the seed alone, not on the size.
    small, _ = _least_squares(512)
    torch.testing.assert_close(small, coef, atol=0.03, rtol=0)


def test_a_resume_over_another_digits_split_is_refused_naming_the_content():
    """The same sizes drawn another way (here another seed's split; a version of the split, or
    other MNIST files, alike) are other samples at each index: a resume says so."""
    from ddpkit._errors import ConfigError

    loader = ddpkit.build_loader(digits("train", seed=0), 32, seed=1, num_workers=0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    same = ddpkit.build_loader(digits("train", seed=0), 32, seed=1, num_workers=0)
    same.load_state_dict(state)  # the same split: resumed
    assert same.batch_in_epoch == 2
    other = ddpkit.build_loader(digits("train", seed=1), 32, seed=1, num_workers=0)
    with pytest.raises(ConfigError, match=r"the data changed .*dataset: 1437 samples .*content"):
        other.load_state_dict(state)
    # Control: as plain TensorDatasets of the same sizes, the two splits look alike to a resume.
    plain = [torch.utils.data.TensorDataset(*digits("train", seed=s).tensors) for s in (0, 1)]
    loader = ddpkit.build_loader(plain[0], 32, seed=1, num_workers=0)
    it = iter(loader)
    next(it), next(it)
    ddpkit.build_loader(plain[1], 32, seed=1, num_workers=0).load_state_dict(loader.state_dict())
