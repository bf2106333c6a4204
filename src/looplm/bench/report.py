"""What every benchmark reports: the machine it ran on, a short table, and the result as JSON; and the values its
command lines spell (token ranges, comma lists)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from ..util import write_json_atomic


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def cell(x) -> str:
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.4g}"
    return str(x)


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; columns that hold numbers are right-aligned."""
    numeric = [any(isinstance(row[i], (int, float)) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def finish(result: dict, header: list[str], rows: list[list], out: str | None) -> None:
    """Print the machine and the table, and write ``result`` as JSON to ``out`` (when given)."""
    m = result["machine"]
    print(f"\n{m['cpu']}, {m['torch_threads']} torch threads, {m['device']}, torch {m['torch']}")
    print(table(header, rows))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, result)
        print(f"wrote {path}")


def token_range(text: str) -> tuple[int, int]:
    """LO:HI (or N for N:N) token counts."""
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def int_list(text: str) -> list[int]:
    """A comma list of positive integers."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def str_list(text: str) -> list[str]:
    """A comma list of words."""
    return [w.strip() for w in text.split(",") if w.strip()]


def choice_list(*choices: str):
    """An argparse ``type``: a comma list of some of ``choices``."""

    def parse(text: str) -> list[str]:
        words = str_list(text)
        if not words or any(w not in choices for w in words):
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(choices)}, got {text!r}")
        return words

    return parse
