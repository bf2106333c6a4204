"""Maintained benchmarks behind `looplm bench`."""
