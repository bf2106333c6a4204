"""`looplm docs render`: the figures of README.md and docs/ written from their results files (docs/render.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..settings import setting
from . import command


@dataclass
class Render:
    """Write the figures of README.md and docs/ from their results files (docs/results/figures/)."""

    check: bool = setting(False, "write nothing; exit 1 listing every figure that differs")
    root: str = setting(".", "the repository root")


@command("docs", "render")
def cmd_render(s: Render) -> int:
    from ..docs.render import render

    differs, errors = render(Path(s.root), s.check)
    problems = errors + (differs if s.check else [])
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        what = "differ from their results files" if s.check else "cannot be rendered"
        print(f"looplm docs render: {len(problems)} markers or figures {what}", file=sys.stderr)
    return 1 if problems else 0
