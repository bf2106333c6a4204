"""The error types every area raises, at the bottom of the package so that any module may import them.

Both are ValueErrors whose message says what is wrong and how to fix it; the `looplm` command prints
them as one line with exit code 2."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user: printed as one line, exit code 2."""


class ConfigError(ValueError):
    """A config or a conversion setting that cannot work; the message says how to fix it."""
