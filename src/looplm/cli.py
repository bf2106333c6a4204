"""The `looplm` command. Each area registers its own subcommands (a `register(subparsers)` function
in its `cli` module, listed in COMMAND_MODULES); this file only dispatches and turns known errors
into one-line messages with exit code 2."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

COMMAND_MODULES = [
    "looplm.cli_core",
    "looplm.eval.cli",
    "looplm.train.cli",
    "looplm.serve.cli",
]


class UsageError(ValueError):
    """Bad input from the user: printed as one line, exit code 2. (A ValueError, so that it is caught
    even when this file runs as __main__ and the class exists twice.)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="looplm", description="Relaxed Recursive Transformers: convert, uptrain, evaluate and serve looped LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # transformers' per-file loading bars; ours report real work
    from .models import ConfigError
    try:
        return int(args.func(args) or 0)
    except (UsageError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"looplm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"looplm {args.command}: interrupted", file=sys.stderr)
        return 130


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


if __name__ == "__main__":
    sys.exit(main())
