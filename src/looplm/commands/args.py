"""A command's arguments made from its settings dataclass (looplm/settings.py ``setting``), and the settings from the
parsed arguments.

The model is each command's first positional argument. A flag that was renamed is refused with a one-line error
that names its new name (``add_renamed``), so that an old command line fails at once instead of running with a
default in place of what it meant."""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from dataclasses import MISSING, Field, asdict, fields, is_dataclass
from pathlib import Path

from ..errors import UsageError
from ..util import write_json_atomic

ADVANCED = "advanced"
ADVANCED_WHAT = "research knobs; the defaults are the recommended recipe"


class HelpFormatter(argparse.HelpFormatter):
    """Every flag shows its default. A default of None (the help says what happens then), a switch's False, an empty
    list and a help text that already names its default get no "(default: ...)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
            or action.default == []
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        if isinstance(action.default, (list, tuple)):  # a comma list, or a range LO:HI, as it is typed
            sep = "," if isinstance(action.default, list) else ":"
            return f"{text} (default: {sep.join(map(str, action.default))})"
        return f"{text} (default: %(default)s)"


class RawEpilogFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """Defaults shown, and the epilog kept as written (a list of sources)."""


class _Renamed(argparse.Action):
    """An old flag name: refused, naming what replaced it."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        use = f"use {self.new}" if self.new.startswith("--") else self.new
        parser.error(f"{option_string} was removed; {use}")


def add_renamed(parser, old: str, new: str) -> None:
    """Refuse the old flag name ``old`` with an error that names ``new``; not listed in the help."""
    parser.add_argument(old, dest=f"_renamed_{old.lstrip('-').replace('-', '_')}", action=_Renamed, new=new)


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_fields(cls: type) -> list[Field]:
    """The fields of ``cls`` that are flags (not positionals), in field order."""
    return [f for f in fields(cls) if "help" in f.metadata and not f.metadata.get("positional")]


def positional_fields(cls: type) -> list[Field]:
    return [f for f in fields(cls) if f.metadata.get("positional")]


def _value_type(annotation):
    """int for ``int``, ``int | None`` and ``Optional[int]``; the item type of ``list[str]``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"a flag needs one type, not {annotation}")
        annotation = kinds[0]
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0]
    return annotation


def _default(f: Field):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def add_positionals(parser: argparse.ArgumentParser, cls: type) -> None:
    """The positional arguments of ``cls``, in field order; a ``model`` among them also refuses ``--model``."""
    hints = typing.get_type_hints(cls)
    for f in positional_fields(cls):
        m = f.metadata
        nargs = m.get("nargs") or (None if _default(f) is None else "?")  # None: the argument must be given
        kwargs: dict = {"help": m["help"], "nargs": nargs, "default": _default(f)}
        if m.get("parse") or _value_type(hints[f.name]) is not str:
            kwargs["type"] = m.get("parse") or _value_type(hints[f.name])
        if "metavar" in m:
            kwargs["metavar"] = m["metavar"]
        if nargs is None:
            del kwargs["nargs"], kwargs["default"]
        parser.add_argument(f.name, **kwargs)
        if f.name == "model":
            prog = getattr(parser, "prog", "looplm")
            add_renamed(parser, "--model", f"no flag: give the model as the first argument (`{prog} MODEL ...`)")


def add_flags(parser: argparse.ArgumentParser, cls: type, first: tuple[str, ...] = ()) -> None:
    """A flag for every ``setting`` field of ``cls``: the fields named in ``first`` in that order, then the others
    in field order, those ``cls`` declares before those it shares with its bases. The advanced ones go in the
    parser's "advanced" group, those of a ``group`` in theirs; a field's old names are refused, naming the new
    one."""
    hints = typing.get_type_hints(cls)
    given = flag_fields(cls)
    names = {f.name for f in given}
    missing = [n for n in first if n not in names]
    if missing:
        raise ValueError(f"{cls.__name__} has no flag fields {missing}")
    rank = {name: i for i, name in enumerate(first)}
    shared = {f.name for base in cls.__mro__[1:] if is_dataclass(base) for f in fields(base)}
    given.sort(key=lambda f: (0, rank[f.name]) if f.name in rank else (1 + (f.name in shared), 0))  # stable
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[tuple[int, str], argparse._MutuallyExclusiveGroup] = {}
    for f in given:
        m = f.metadata
        container = parser
        title = m.get("group")
        if m.get("advanced"):
            title = f"{ADVANCED} ({m['advanced'] if isinstance(m['advanced'], str) else ADVANCED_WHAT})"
        if title:
            container = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        if m.get("exclusive"):
            key = (id(container), m["exclusive"])
            if key not in exclusive:
                exclusive[key] = container.add_mutually_exclusive_group()
            container = exclusive[key]
        name = flag_name(f)
        kind = _value_type(hints[f.name])
        kwargs: dict = {"dest": f.name, "help": m["help"]}
        if kind is bool:
            if f.default is False:
                kwargs["action"] = "store_true"
            else:  # True, or None: the recipe chooses
                kwargs.update(action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kwargs.update(type=m.get("parse") or kind, default=_default(f))
            if m.get("repeat"):
                kwargs["action"] = "append"
            if "choices" in m:
                kwargs["choices"] = list(m["choices"])
            if "metavar" in m:
                kwargs["metavar"] = m["metavar"]
            if m.get("required"):
                kwargs.update(required=True, default=None)
        container.add_argument(name, **kwargs)
        for old in m.get("renamed_from", ()):
            add_renamed(parser, old, name)


def from_args(cls: type, args: argparse.Namespace):
    """The settings ``cls`` of parsed arguments: every field the arguments hold, the others at their defaults; a
    value below its field's ``minimum`` is refused."""
    given = vars(args)
    values = {f.name: given[f.name] for f in fields(cls) if f.name in given}
    for f in fields(cls):  # flags and --config files alike
        low, value = f.metadata.get("minimum"), values.get(f.name, _default(f))
        if low is not None and value is not None and value < low:
            raise UsageError(f"{flag_name(f)} must be >= {low}, got {value}")
    return cls(**values)


def call_with(target, settings, **given):
    """``target(...)``, a library function or settings dataclass, with each of its parameters that the command's
    ``settings`` hold under the same name, then ``given``: what the command computes, renames or keeps from it. A
    setting is passed on by its name instead of restated field by field."""
    params = inspect.signature(target).parameters
    held = {name: getattr(settings, name) for name in params if name not in given and hasattr(settings, name)}
    return target(**held, **given)


def setting_values(settings) -> dict:
    """{name: value} of every argument of a command (a field kept off the command line is the code's, not the
    run's): what ``--config FILE`` reads back."""
    values = asdict(settings)
    return {f.name: values[f.name] for f in fields(settings) if "help" in f.metadata}


def settings_record(command: str, settings) -> dict:
    return {"command": command, "settings": setting_values(settings)}


def write_settings(directory, command: str, settings) -> Path:
    """The settings a run ran with, into its output directory as command.json: `looplm ... --config
    DIR/command.json` repeats it."""
    path = Path(directory) / "command.json"
    write_json_atomic(path, settings_record(command, settings))
    return path
