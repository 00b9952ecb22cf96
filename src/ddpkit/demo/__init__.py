"""Data sets and models for the examples, tests and benchmarks; not part of the library's API."""

from ddpkit.demo._datasets import (
    CHARS,
    IGNORE_INDEX,
    decode,
    digits,
    encode,
    mnist,
    python_source,
    toy_regression,
)
from ddpkit.demo._models import DigitsCNN, TinyGPT

__all__ = [
    "CHARS", "IGNORE_INDEX", "DigitsCNN", "TinyGPT", "decode", "digits", "encode", "mnist",
    "python_source", "toy_regression",
]  # fmt: skip
