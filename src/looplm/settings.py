"""A setting: a dataclass field that is also a command-line argument, so that each default is written once.

Every command is one settings dataclass and one function (looplm/commands). A field made by ``setting`` is a flag
(``--`` and its name with dashes, unless ``flag`` names it) or, with ``positional``, an argument; any other field is
not on the command line. The flag's type is the field's (``int | None`` -> int, or ``parse``); a boolean is a
switch: ``--x`` when it defaults to False, ``--x/--no-x`` otherwise. A default of None means "the recipe chooses"
(the help says what it chooses). ``commands/args.py`` makes the parser's flags from a settings class and the
settings from the parsed arguments; a subclass refines an inherited field's help or old names with ``refine``, its
default staying the base's.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, field

_KEYS = (
    "help",
    "flag",
    "positional",
    "nargs",
    "repeat",
    "parse",
    "choices",
    "metavar",
    "renamed_from",
    "advanced",
    "group",
    "exclusive",
    "required",
    "minimum",
)


def _metadata(**kw) -> dict:
    unknown = set(kw) - set(_KEYS)
    if unknown:
        raise TypeError(f"unknown setting options {sorted(unknown)}; the options are {', '.join(_KEYS[1:])}")
    if kw.get("choices") is not None:
        kw["choices"] = tuple(kw["choices"])
    return {k: v for k, v in kw.items() if v is not None and v is not False}


def setting(default, help: str, **options) -> Field:
    """A dataclass field that is also a command-line argument.

    help: the argument's help (the default is added to it by the help formatter, unless the help names it).
    The options (keywords; any other is refused):
    flag: the flag's name (default ``--`` and the field's name with dashes).
    positional: an argument, not a flag: it must be given where its default is None, else it may be left out;
        ``nargs`` "?" leaves it out at None too, "+" or "*" takes a list.
    repeat: a flag that may be given again, each value added to a list (the default: an empty list).
    parse: the function that turns the text into the value (default: the field's type).
    choices, metavar: as argparse's.
    renamed_from: old names of the flag, refused with an error that names the new one.
    advanced: listed in the "advanced" group of research knobs (a text: that group's own title).
    group: listed in an argument group of this title.
    exclusive: a name; the flags of one name form a mutually exclusive group (the budget: one of them).
    required: the flag must be given.
    minimum: the smallest value the command takes (None, where the default is None, stays allowed).
    """
    meta = _metadata(help=help, **options)
    if meta.get("repeat") or meta.get("nargs") in ("+", "*") or isinstance(default, list):
        given = list(default or ())
        return field(default_factory=lambda: list(given), metadata=meta)
    return field(default=default, metadata=meta)


def refine(base: type, name: str, **changes) -> Field:
    """The field ``name`` of ``base`` with some of its argument's metadata changed (a subclass's own help, old
    names): the default stays the one ``base`` wrote."""
    f = base.__dataclass_fields__[name]
    if f.default is MISSING:
        raise TypeError(f"{base.__name__}.{name} has no default to refine")
    return field(default=f.default, metadata={**f.metadata, **_metadata(**changes)})


__all__ = ["refine", "setting"]
