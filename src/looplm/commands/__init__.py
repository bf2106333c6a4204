"""The `looplm` command. Every command is one settings dataclass and one function, registered by ``@command(WORDS)``
in the module of its area (commands/convert.py, data.py, ...); its flags, help, defaults, choices and advanced group
come from the dataclass (looplm/settings.py ``setting``), its one-line help from the dataclass's docstring. This file
builds the parser, reads ``--config FILE`` and dispatches, turning known errors into one-line messages with exit code
2."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError, UsageError
from .args import HelpFormatter, RawEpilogFormatter, add_flags, add_positionals, from_args

MODULES = ("convert", "data", "eval", "train", "serve", "bench", "docs")
GROUPS = {  # commands with subcommands
    "data": "Training corpora.",
    "eval": "Evaluate a model.",
    "bench": "Benchmarks: serving, llama.cpp side by side, speculation, a heal step, a train step.",
    "docs": "The project's docs.",
}


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # ("eval", "suite"): `looplm eval suite`
    settings: type  # its settings dataclass: every argument is a field
    run: Callable  # run(settings) -> its exit code, or its result (printed with --json)
    help: str
    first: tuple[str, ...] = ()  # the flags its help lists first, in this order
    epilog: Callable[[], str] | None = None  # help text after the flags, kept as written

    @property
    def name(self) -> str:
        return "looplm " + " ".join(self.words)


_REGISTERED: list[Command] = []


def command(*words: str, help: str | None = None, first: tuple[str, ...] = (), epilog=None):
    """Register ``run(settings)`` as `looplm WORDS`: it returns its exit code, or its result (see ``_run``). Its
    settings dataclass is the type of its one parameter; its help is ``help``, else the first paragraph of that
    dataclass's docstring."""

    def register(run: Callable) -> Callable:
        (settings,) = (kind for name, kind in typing.get_type_hints(run).items() if name != "return")
        doc = settings.__doc__ or ""
        if help is None and doc.startswith(settings.__name__ + "("):  # the signature a dataclass writes for itself
            raise TypeError(f"{settings.__name__} needs a docstring or `looplm {' '.join(words)}` a help")
        text = help or " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
        _REGISTERED.append(Command(words, settings, run, text, first, epilog))
        return run

    return register


def all_commands() -> list[Command]:
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return list(_REGISTERED)


def build_parser() -> argparse.ArgumentParser:
    """The `looplm` parser; ``parser.leaves`` maps each command's words to its own parser."""
    parser = argparse.ArgumentParser(
        prog="looplm", description="Relaxed Recursive Transformers: convert, uptrain, evaluate and serve looped LLMs."
    )
    groups = {(): parser.add_subparsers(dest="command", required=True)}  # words so far -> their subcommands
    parser.leaves = {}
    for cmd in all_commands():
        for depth in range(1, len(cmd.words)):
            path = cmd.words[:depth]
            if path not in groups:
                group = groups[path[:-1]].add_parser(path[-1], help=GROUPS[path[-1]])
                groups[path] = group.add_subparsers(dest=f"{path[-1]}_command", required=True)
        p = groups[cmd.words[:-1]].add_parser(
            cmd.words[-1],
            help=cmd.help,
            formatter_class=RawEpilogFormatter if cmd.epilog else HelpFormatter,
            epilog=cmd.epilog() if cmd.epilog else None,
        )
        add_positionals(p, cmd.settings)
        add_flags(p, cmd.settings, first=cmd.first)
        p.add_argument(
            "--config",
            default=None,
            metavar="FILE",
            help="read the settings from this JSON file (the command.json a run wrote, or {name: value}); flags "
            "given beside it win",
        )
        p.set_defaults(_command=cmd)
        parser.leaves[cmd.words] = p
    return parser


def _config_defaults(path: str, cmd: Command) -> dict:
    """The settings a --config file gives, in the command line's spelling, refused where a name is not one of the
    command's settings."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--config {path}: cannot read it as JSON ({e})") from None
    values = data.get("settings", data) if isinstance(data, dict) else None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: expected a JSON object of settings")
    known = {f.name: f for f in fields(cmd.settings) if "help" in f.metadata}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise UsageError(f"--config {path}: {', '.join(unknown)} are not settings of `{cmd.name}`; see its --help")
    return values


def parse(argv: list[str] | None = None):
    """(the command, its settings) of a command line. With ``--config FILE`` the file's settings are the command's
    defaults (the flags given beside it win), so a setting the file gives need not be given again."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    config = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    config.add_argument("--config")
    path = config.parse_known_args(argv)[0].config
    if path is not None:
        words = tuple(w for w in argv[:2] if not w.startswith("-"))
        cmd = next((c for c in all_commands() if c.words == words[: len(c.words)]), None)
        if cmd is not None:
            leaf = parser.leaves[cmd.words]
            values = _config_defaults(path, cmd)
            for action in leaf._actions:
                if action.dest in values and action.required:
                    action.required = False
                    if not action.option_strings:
                        action.nargs = "?"
            leaf.set_defaults(**values)
    args = parser.parse_args(argv)
    return args._command, from_args(args._command.settings, args)


def _run(cmd: Command, settings) -> int:
    """Run a command. It returns its exit code (an int or None), or its result: with ``--json`` the result is printed
    as one JSON document, and whatever the run printed went to stderr, so that stdout holds that one document. A
    result whose ``ok`` is false exits 1."""
    as_json = getattr(settings, "json", False)
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        result = cmd.run(settings)
    if result is None or isinstance(result, int):
        return int(result or 0)
    if as_json:
        print(json.dumps(result, indent=2, default=str), file=stdout)
    return 1 if isinstance(result, dict) and result.get("ok") is False else 0


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    name = "looplm " + next((w for w in words if not w.startswith("-")), "")
    try:
        cmd, settings = parse(argv)
        name = cmd.name
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # transformers' per-file loading bars; ours report real work
        if getattr(settings, "threads", None):  # every command with a --threads setting
            import torch

            torch.set_num_threads(settings.threads)
        return _run(cmd, settings)
    except (UsageError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


__all__ = ["Command", "all_commands", "build_parser", "command", "main", "parse"]
