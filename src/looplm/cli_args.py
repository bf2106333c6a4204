"""Arguments every command spells the same way.

The model is each command's first positional argument. ``--model`` is still accepted for one release:
``main`` moves it into the positional's place and prints a deprecation note (``resolve_model_alias``).
A renamed flag keeps its old name for one release the same way (``add_deprecated``)."""

from __future__ import annotations

import argparse
import sys

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
