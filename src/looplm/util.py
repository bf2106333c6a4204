"""Small helpers the command modules of every area share (bottom of the package: imports nothing of it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .errors import UsageError


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def read_text_arg(path: str | None, default: Path | None = None) -> str:
    p = Path(path) if path else default
    if p is None:
        raise UsageError("give a text file with --text FILE")
    if not p.exists():
        raise UsageError(f"text file {p} does not exist")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UsageError(f"text file {p} is empty; give a file with text in it")
    return text


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a reader (or a run killed meanwhile) sees the old file or the new one, never half."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
