"""Data sets and models for the examples, tests and benchmarks; not part of the library's API."""
