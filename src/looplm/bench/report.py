"""What every benchmark reports: the machine it ran on, a short table, and the result as JSON."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


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


def finish(result: dict, header: list[str], rows: list[list], out: str | None, say=print) -> None:
    """Print the machine and the table, and write ``result`` as JSON to ``out`` (when given)."""
    m = result["machine"]
    say(f"\n{m['cpu']}, {m['torch_threads']} torch threads, {m['device']}, torch {m['torch']}")
    say(table(header, rows))
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        say(f"wrote {path}")
