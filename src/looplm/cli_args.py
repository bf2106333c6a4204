"""Arguments every command spells the same way.

The model is each command's first positional argument. ``--model`` is still accepted for one release:
``main`` moves it into the positional's place and prints a deprecation note (``resolve_model_alias``).
A renamed flag keeps its old name for one release the same way (``add_deprecated``)."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import Field, fields, is_dataclass

MODEL_ALIAS = "model_alias"
_MODEL_REQUIRED = "_model_required"
_MODEL_SPILL = "_model_spill"
_PROG = "_prog"
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


def add_model(
    parser: argparse.ArgumentParser,
    help: str,
    default: str | None = None,
    required: bool = True,
    spill: str | None = None,
) -> None:
    """The model as the first positional argument and the deprecated ``--model`` alias. With a ``default``, or
    ``required=False`` (a resumed run reads it from its directory), the positional may be left out. ``spill``
    names a positional list after it (generate's prompts): with ``--model`` given, a word the positional took
    belongs to that list."""
    # optional to argparse, so that the alias alone parses; resolve_model_alias asks for it when it is needed
    parser.add_argument("model", nargs="?", default=default, help=help)
    deprecated_group(parser).add_argument(
        "--model", dest=MODEL_ALIAS, default=None, metavar="MODEL", help="deprecated name of the positional MODEL"
    )
    parser.set_defaults(**{_MODEL_REQUIRED: required and default is None, _MODEL_SPILL: spill, _PROG: parser.prog})


def resolve_model_alias(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    prog = getattr(args, _PROG, f"looplm {args.command}")
    alias = getattr(args, MODEL_ALIAS, None)
    if alias is None:
        if getattr(args, _MODEL_REQUIRED, False) and getattr(args, "model", None) is None:
            parser.error(f"{prog.removeprefix('looplm ')}: give the model as the first argument")
        return
    print(
        f"{prog}: note: --model is deprecated; give the model as the first argument (`{prog} {alias} ...`)",
        file=sys.stderr,
    )
    spill = getattr(args, _MODEL_SPILL, None)
    if spill and args.model is not None:
        getattr(args, spill).insert(0, args.model)
    args.model = alias


def advanced(
    parser: argparse.ArgumentParser, what: str = "research knobs; the defaults are the recommended recipe"
) -> argparse._ArgumentGroup:
    """The argument group of knobs kept for research."""
    return parser.add_argument_group(f"{ADVANCED} ({what})")


def deprecated_group(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The parser's argument group of old flag names, listed last in its help."""
    group = getattr(parser, "_looplm_deprecated", None)
    if group is None:
        group = parser._looplm_deprecated = parser.add_argument_group(
            "deprecated (old names, accepted until the next release)"
        )
    return group


class _Deprecated(argparse.Action):
    """An old flag name: stores into the new flag's dest and says, once used, which name replaces it."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: note: {option_string} is deprecated; use {self.new} (the old name goes in the next "
            f"release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_deprecated(container, old: str, new: str, dest: str, **kwargs) -> None:
    """``old`` accepted for one release as another name of the flag ``new`` (whose value lands in ``dest``),
    listed in the parser's "deprecated" group (or in ``container`` when that is a mutually exclusive group)."""
    if isinstance(container, argparse.ArgumentParser):
        container = deprecated_group(container)
    container.add_argument(
        old,
        dest=dest,
        action=_Deprecated,
        new=new,
        default=argparse.SUPPRESS,
        help=f"deprecated name of {new}",
        **kwargs,
    )


def renamed_choices(flag: str, renamed: dict[str, str]):
    """An argparse ``type`` for an enumeration some of whose values were renamed: an old value is read as its
    new name, with a note."""

    def convert(value: str) -> str:
        if value in renamed:
            print(f"looplm: note: {flag} {value} is deprecated; use {flag} {renamed[value]}", file=sys.stderr)
            return renamed[value]
        return value

    return convert


def deprecated_last(parser: argparse.ArgumentParser) -> None:
    """Move every (sub)parser's "deprecated" group to the end of its help."""
    group = getattr(parser, "_looplm_deprecated", None)
    if group is not None:
        parser._action_groups.remove(group)
        parser._action_groups.append(group)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                deprecated_last(sub)


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
    parser's "advanced" group, old names in its "deprecated" group (or beside the new name in a mutually exclusive
    group)."""
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
        alias_kwargs: dict = {}
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
            alias_kwargs = {"type": convert, "metavar": m.get("metavar", "N" if kind in (int, float) else None)}
        container.add_argument(name, **kwargs)
        for old in m.get("aliases", ()):
            if kind is bool:
                raise TypeError(f"{cls.__name__}.{f.name}: old names of a switch are not supported")
            add_deprecated(
                container if m.get("exclusive") else parser,
                old,
                name,
                f.name,
                **{k: v for k, v in alias_kwargs.items() if v is not None},
            )


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
