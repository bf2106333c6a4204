"""Arguments every command spells the same way.

The model is each command's first positional argument. A flag that was renamed is refused with a one-line error
that names its new name (``add_renamed``), so that an old command line fails at once instead of running with a
default in place of what it meant."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import Field, fields, is_dataclass

ADVANCED = "advanced"


class HelpFormatter(argparse.HelpFormatter):
    """Every flag shows its default. A default of None (the help says what happens then), a switch's False and
    a help text that already names its default get no "(default: ...)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
            or not (action.option_strings or action.nargs in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)"


def add_model(parser, help: str, default: str | None = None, required: bool = True) -> None:
    """The model as the first positional argument. With a ``default``, or ``required=False`` (a resumed run reads
    it from its directory), it may be left out."""
    optional = default is not None or not required
    parser.add_argument("model", nargs="?" if optional else None, default=default, help=help)
    prog = getattr(parser, "prog", "looplm")
    add_renamed(parser, "--model", f"no flag: give the model as the first argument (`{prog} MODEL ...`)")


def advanced(
    parser: argparse.ArgumentParser, what: str = "research knobs; the defaults are the recommended recipe"
) -> argparse._ArgumentGroup:
    """The argument group of knobs kept for research."""
    return parser.add_argument_group(f"{ADVANCED} ({what})")


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


def renamed_choices(flag: str, renamed: dict[str, str], kind=str):
    """An argparse ``type`` for an enumeration some of whose values were renamed: an old value is refused with
    its new name."""

    def convert(value: str):
        if value in renamed:
            raise argparse.ArgumentTypeError(f"{flag} {value} was renamed: use {flag} {renamed[value]}")
        return kind(value)

    return convert


# ---------------------------------------------------------------------------------------------
# flags from a settings dataclass (train/settings.py ``setting``: each default written once)


def flag_name(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_fields(cls: type) -> list[Field]:
    """The fields of ``cls`` that are flags, in field order."""
    return [f for f in fields(cls) if "help" in f.metadata]


def _value_type(annotation) -> type:
    """int for ``int``, ``int | None`` and ``Optional[int]``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"a flag needs one type, not {annotation}")
        return kinds[0]
    return annotation


def add_flags(parser: argparse.ArgumentParser, cls: type, first: tuple[str, ...] = ()) -> None:
    """A flag for every ``setting`` field of ``cls``: the fields named in ``first`` in that order, then the others
    in field order, those ``cls`` declares before those it shares with its bases. The advanced ones go in the
    parser's "advanced" group; a field's old names are refused, naming the new one."""
    hints = typing.get_type_hints(cls)
    given = flag_fields(cls)
    names = {f.name for f in given}
    missing = [n for n in first if n not in names]
    if missing:
        raise ValueError(f"{cls.__name__} has no flag fields {missing}")
    rank = {name: i for i, name in enumerate(first)}
    shared = {f.name for base in cls.__mro__[1:] if is_dataclass(base) for f in fields(base)}
    given.sort(key=lambda f: (0, rank[f.name]) if f.name in rank else (1 + (f.name in shared), 0))  # stable
    research = None
    exclusive: dict[tuple[int, str], argparse._MutuallyExclusiveGroup] = {}
    for f in given:
        m = f.metadata
        container = parser
        if m.get("advanced"):
            research = research or advanced(parser)
            container = research
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
            spelled = m.get("spelled", {})
            convert = renamed_choices(name, spelled) if spelled else kind
            kwargs.update(type=convert, default=spelled.get(f.default, f.default))
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
    """The settings ``cls`` of parsed arguments: every field the arguments hold (a flag's value in the dataclass's
    spelling), the others at their defaults."""
    given = vars(args)
    values = {}
    for f in fields(cls):
        if f.name in given:
            value = given[f.name]
            spelled = f.metadata.get("spelled")
            if spelled:
                value = {v: k for k, v in spelled.items()}.get(value, value)
            values[f.name] = value
    return cls(**values)
