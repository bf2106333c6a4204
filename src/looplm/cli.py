"""The `looplm` command. Each area registers its own subcommands (a `register(subparsers)` function
in its `cli` module, listed in COMMAND_MODULES); this file only dispatches and turns known errors
into one-line messages with exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import ConfigError, UsageError

COMMAND_MODULES = [
    "looplm.convert.cli",
    "looplm.data.cli",
    "looplm.eval.cli",
    "looplm.train.cli",
    "looplm.serve.cli",
    "looplm.bench.cli",
    "looplm.docs.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="looplm", description="Relaxed Recursive Transformers: convert, uptrain, evaluate and serve looped LLMs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-file loading bars; ours report real work
    try:
        return int(args.func(args) or 0)
    except (UsageError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"looplm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"looplm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
