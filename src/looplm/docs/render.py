"""The figures of README.md and docs/ written from their results files (`looplm docs render`).

Every figure the docs quote lives once, in a figure set: a JSON file under docs/results/figures/ holding its
figures, each with the quantity and the protocol it was measured under (a text of docs/results/protocols.json: the
text, its windows or documents), and the command, machine, commit and minutes that produced them. A figure's value
is written there (``"value"``) or read from a raw results file (``"from"``, ``"path"``, ``"format"``, ``"scale"``).
A page quotes a set through markers whose contents this command writes:

    <!-- fig SET.KEY -->1.44x<!-- /fig -->    figure KEY of SET (or the set's machine, minutes or commit)
    <!-- fig SET -->...<!-- /fig -->          the set's reproduce block: command, machine, minutes, commit, results

A new figure is one set file and one marker. ``--check`` writes nothing and exits 1, listing every marker that
differs from its files, every quantity the files give two values under one protocol, and every malformed set."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from ..errors import UsageError

FIGURES = Path("docs/results/figures")
PROTOCOLS = Path("docs/results/protocols.json")
MARKER = re.compile(r"<!-- fig (?P<name>[a-z0-9-]+)(?:\.(?P<key>[a-z0-9_]+))? -->(?P<body>.*?)<!-- /fig -->", re.S)
OPENING = re.compile(r"<!-- fig [a-z0-9-]+(?:\.[a-z0-9_]+)? -->")
# a set's title names it in its reproduce line ("To reproduce the default hour: ...")
SET_FIELDS = ("title", "model", "machine", "command", "commit", "minutes", "figures")
FIGURE_FIELDS = ("quantity", "protocol")
INLINE_FIELDS = ("machine", "minutes", "commit")


@dataclass
class FigureSet:
    name: str
    path: Path
    data: dict = field(repr=False)

    def entry(self, key: str) -> dict:
        try:
            return self.data["figures"][key]
        except KeyError:
            raise UsageError(f"{self.path}: no figure {key!r}") from None

    def value(self, key: str) -> str:
        fig = self.entry(key)
        if "value" in fig:
            return str(fig["value"])
        raw = _walk(_read_json(self.path.parent / fig["from"]), fig["path"], f"{self.path}: {key}")
        return fig.get("format", "{}").format(raw * fig.get("scale", 1))

    def identity(self, key: str) -> tuple[str, str, str, str]:
        """What a figure measures: (model, quantity, protocol, machine); one value per identity."""
        fig = self.entry(key)
        return (
            fig.get("model", self.data["model"]),
            fig["quantity"],
            fig["protocol"],
            fig.get("machine", self.data["machine"]),
        )


@cache
def _read_json(path: Path):
    return json.loads(path.read_text())


def _walk(data, path: list, where: str):
    """The value at ``path`` in raw results: a key, a list index, or {field: value} for the first list item that
    has it (a suite's row by name)."""
    for step in path:
        if isinstance(step, dict):
            data = next((item for item in data if all(item.get(k) == v for k, v in step.items())), None)
        else:
            data = data[step] if isinstance(data, list) or step in data else None
        if data is None:
            raise UsageError(f"{where}: nothing at {step!r} of {path}")
    return data


def load_sets(root: Path) -> dict[str, FigureSet]:
    return {p.stem: FigureSet(p.stem, p, json.loads(p.read_text())) for p in sorted((root / FIGURES).glob("*.json"))}


def load_protocols(root: Path) -> dict:
    return json.loads((root / PROTOCOLS).read_text())


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


# --- what a marker holds ------------------------------------------------------------------------


def inline(fig_set: FigureSet, key: str, protocols: dict) -> str:
    if key in fig_set.data["figures"]:
        return fig_set.value(key)
    if key == "machine":
        return protocols["machines"][fig_set.data["machine"]]
    if key in INLINE_FIELDS:
        return str(fig_set.data[key])
    raise UsageError(f"{fig_set.path}: no figure {key!r}")


def reproduce(fig_set: FigureSet, page: Path, protocols: dict) -> str:
    """What the set's command printed, when the set records it, then one line: the command, machine, minutes,
    commit, note and results files (linked from the page)."""
    d = fig_set.data
    commands = d["command"] if isinstance(d["command"], list) else [d["command"]]
    links = [f"[{Path(r).name}]({os.path.relpath(fig_set.path.parent / r, page.parent)})" for r in d.get("results", [])]
    machine = protocols["machines"][d["machine"]]
    line = f"To reproduce {d['title']}: " + "; ".join(f"`{c}`" for c in commands)
    line += f". Ran on {machine if machine.startswith('any') else 'a ' + machine} in {_minutes(d['minutes'])}"
    line += f" (commit `{d['commit']}`)." + (f" {d['note']}" if d.get("note") else "")
    line += f" Results: {', '.join(links)}." if links else ""
    output = "\n```\n" + "\n".join(d["output"]) + "\n```\n" if d.get("output") else "\n"
    return output + line + "\n"


def _minutes(minutes) -> str:
    """'75' -> '75 minutes', '1' -> '1 minute'; a text that names its unit ('3 minutes a model') as it is."""
    text = str(minutes)
    if "minute" in text:
        return text
    return f"{text} minute" if text.split()[-1] == "1" else f"{text} minutes"


def render_page(text: str, page: Path, root: Path, sets: dict, protocols: dict) -> tuple[str, list, list]:
    """The page with every marker filled; the markers whose contents differed; the ones that cannot be filled."""
    where = page.relative_to(root)
    differs, errors = [], marker_layout(text, where)

    def fill(m: re.Match) -> str:
        name, key, body = m["name"], m["key"], m["body"]
        label = f"{where}: {name}{'.' + key if key else ''}"
        try:
            if name not in sets:
                raise UsageError(f"no figure set {name!r} in {FIGURES}")
            new = inline(sets[name], key, protocols) if key else reproduce(sets[name], page, protocols)
        except (UsageError, KeyError) as e:
            errors.append(f"{label}: {e}")
            return m[0]
        if new != body:
            differs.append(f"{label}: the page has {body!r}, its files give {new!r}")
        start, end = m.start("body") - m.start(), m.end("body") - m.start()
        return m[0][:start] + new + m[0][end:]

    return MARKER.sub(fill, text), differs, errors


def marker_layout(text: str, page: Path) -> list[str]:
    """Markers that would not render: unclosed ones, and inline ones starting a line (an HTML comment there opens
    an HTML block, and the rest of the line loses its markdown)."""
    notes = []
    if len(OPENING.findall(text)) != len(MARKER.findall(text)):
        notes.append(f"{page}: a <!-- fig ... --> marker has no <!-- /fig --> after it")
    for m in MARKER.finditer(text):
        at_line_start = m.start() == 0 or text[m.start() - 1] == "\n"
        if m["key"] and at_line_start:
            notes.append(f"{page}: inline marker {m['name']}.{m['key']} starts a line; move a word before it")
        if not m["key"] and not at_line_start:
            notes.append(f"{page}: block marker {m['name']} must start a line")
    return notes


# --- the sets themselves ------------------------------------------------------------------------


def malformed(sets: dict[str, FigureSet], protocols: dict) -> list[str]:
    notes = []
    for s in sets.values():
        notes += [f"{s.path}: no {f!r}" for f in SET_FIELDS if f not in s.data]
        if s.data.get("machine") not in protocols["machines"]:
            notes.append(f"{s.path}: machine {s.data.get('machine')!r} is not one of {PROTOCOLS}'s machines")
        for key, fig in s.data.get("figures", {}).items():
            notes += [f"{s.path}: figure {key}: no {f!r}" for f in FIGURE_FIELDS if f not in fig]
            if fig.get("protocol") not in protocols["texts"]:
                notes.append(f"{s.path}: figure {key}: protocol {fig.get('protocol')!r} is not in {PROTOCOLS}")
            if ("value" in fig) == ("from" in fig):
                notes.append(f"{s.path}: figure {key}: give either a value or where to read it from")
                continue
            try:
                s.value(key)
            except (UsageError, KeyError, IndexError, TypeError, ValueError, OSError) as e:
                notes.append(f"{s.path}: figure {key}: {e}")
    return notes


def conflicts(sets: dict[str, FigureSet]) -> list[str]:
    """The same quantity of the same model under the same protocol and machine, given twice: a new measurement
    replaces the old one instead of standing beside it."""
    seen: dict[tuple, tuple[str, str]] = {}
    notes = []
    for s in sets.values():
        for key in s.data.get("figures", {}):
            ident, where = s.identity(key), f"{s.name}.{key}"
            if ident in seen:
                other, value = seen[ident]
                notes.append(
                    f"{where} ({s.value(key)}) and {other} ({value}) both give {ident[1]} of {ident[0]} "
                    f"on {ident[2]} ({ident[3]}): keep one"
                )
            else:
                seen[ident] = (where, s.value(key))
    return notes


def render(root: Path, check: bool) -> tuple[list[str], list[str]]:
    """Fill every page's markers (with ``check``, write nothing). Returns (what differed, what is wrong: malformed
    sets, two values for one quantity, markers that cannot be filled)."""
    root = root.resolve()
    if not (root / FIGURES).is_dir():
        raise UsageError(f"no {FIGURES} under {root}: run from the repository root or pass --root")
    sets, protocols = load_sets(root), load_protocols(root)
    errors = malformed(sets, protocols)
    if errors:
        return [], errors
    differs, errors = [], conflicts(sets)
    for page in pages(root):
        text = page.read_text()
        new, page_differs, page_errors = render_page(text, page, root, sets, protocols)
        differs, errors = differs + page_differs, errors + page_errors
        if not check and new != text:
            page.write_text(new)
            print(f"wrote {page.relative_to(root)}")
    return differs, errors
