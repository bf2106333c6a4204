"""The settings of a run, each written once: a dataclass field holds its default, and the field's metadata what the
command line needs (help, choices, metavar, flag name, old names). ``cli_args.add_flags`` makes a parser's flags from a
settings class and ``cli_args.from_args`` the settings from the parsed arguments, so `looplm train` (TrainConfig) and
`looplm heal` (HealConfig) declare nothing twice.

``RunSettings`` is what both have, by one name: the run directory, the budget (minutes or training tokens), the
held-out rows of an evaluation, resume, progress bars, seed and precision. Their evaluation and checkpoint intervals
are each counted in the recipe's own unit, which the name says: `looplm train` counts steps (``eval_every_steps``,
``save_every_steps``: an exact resume repeats them), `looplm heal` seconds (``eval_every_seconds``,
``save_every_seconds``: its stages are planned in time).

A field made by ``setting`` is a flag (``--`` and its name with dashes, unless ``flag`` names it); any other field
(the model, a positional of its own, or a knob kept off the command line) is not. The flag's type is the field's
(``int | None`` -> int); a boolean is a switch: ``--x`` when it defaults to False, ``--x/--no-x`` otherwise. A
default of None means "the recipe chooses" (the help says what it chooses); a subclass refines an inherited
field's help or old names with ``refine``, its default staying the base's.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field

PRECISIONS = ("auto", "bf16", "fp32")
_KEYS = ("help", "flag", "choices", "metavar", "renamed_from", "advanced", "exclusive", "required", "spelled")


def _metadata(**kw) -> dict:
    unknown = set(kw) - set(_KEYS)
    if unknown:
        raise TypeError(f"unknown setting metadata {sorted(unknown)}")
    return {k: v for k, v in kw.items() if v is not None}


def setting(
    default,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple | None = None,
    metavar: str | None = None,
    renamed_from: tuple[str, ...] | None = None,
    advanced: bool | None = None,
    exclusive: str | None = None,
    required: bool | None = None,
    spelled: dict | None = None,
) -> Field:
    """A dataclass field that is also a flag.

    help: the flag's help (the default is added to it by the help formatter, unless the help names it).
    flag: the flag's name (default ``--`` and the field's name with dashes).
    choices, metavar: as argparse's.
    renamed_from: old names of the flag, refused with an error that names the new one (cli_args.add_renamed).
    advanced: listed in the "advanced" group of research knobs.
    exclusive: a name; the flags of one name form a mutually exclusive group (the budget: one of them).
    required: the flag must be given.
    spelled: the dataclass's values the command line spells otherwise ({value: spelling}); the dataclass's own
        spelling is refused on the command line, naming the flag's.
    """
    meta = _metadata(
        help=help,
        flag=flag,
        choices=choices,
        metavar=metavar,
        renamed_from=renamed_from,
        advanced=advanced,
        exclusive=exclusive,
        required=required,
        spelled=spelled,
    )
    return field(default=default, metadata=meta)


def refine(base: type, name: str, **changes) -> Field:
    """The field ``name`` of ``base`` with some of its flag's metadata changed (a subclass's own help, old names):
    the default stays the one ``base`` wrote."""
    f = base.__dataclass_fields__[name]
    if f.default is MISSING:
        raise TypeError(f"{base.__name__}.{name} has no default to refine")
    return field(default=f.default, metadata={**f.metadata, **_metadata(**changes)})


@dataclass
class RunSettings:
    """The settings every run has, by one name (the budget: one of ``budget_minutes``, ``train_tokens`` and, for a
    recipe that has it, ``max_steps``)."""

    out: str | None = setting(None, "run directory")
    budget_minutes: float | None = setting(None, "minutes of training", exclusive="budget", metavar="M")
    train_tokens: int | None = setting(None, "instead: training tokens to read", exclusive="budget", metavar="N")
    eval_rows: int = setting(16, "held-out rows scored at each evaluation", metavar="N")
    resume: bool = setting(False, "continue the run in --out from its latest checkpoint")
    progress: bool = setting(True, "progress bars on stderr")
    seed: int = setting(0, "seed of the data order and of new parameters", advanced=True)
    precision: str = setting(
        "auto",
        "auto: bf16 autocast where the hardware multiplies bf16 natively, else fp32",
        choices=PRECISIONS,
        advanced=True,
    )


__all__ = ["PRECISIONS", "RunSettings", "refine", "setting"]
