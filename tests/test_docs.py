"""The docs as built: every figure a page quotes is the one its results file gives (`looplm docs render --check`),
no quantity is given two values, every internal link and heading anchor resolves, every documented `looplm`
command parses with the real parser (a few cheap ones run), and the pages keep to their size goals.

Fast and model-free: the cheap commands run on a tiny random model; nothing reads the real weights."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from looplm.commands import build_parser, main
from looplm.docs.render import conflicts, load_sets, pages, render

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
FENCE = re.compile(r"^```([\w-]*)\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


# --- the figures ----------------------------------------------------------------------------


def test_every_page_gives_the_figures_of_its_results_files():
    differs, errors = render(ROOT, check=True)
    assert not errors, "figures that cannot be rendered:\n" + "\n".join(errors)
    assert not differs, "pages that differ from their results files (run `looplm docs render`):\n" + "\n".join(differs)


def test_no_quantity_has_two_values():
    assert conflicts(load_sets(ROOT)) == []


def _tiny_docs(root: Path, page_value: str, second_value: str | None = None) -> None:
    """A repository of one page, one figure set (a figure typed, one read from a raw results file) and,
    with ``second_value``, a second set measuring the first set's quantity again."""
    results = root / "docs" / "results"
    (results / "figures").mkdir(parents=True)
    protocols = {"machines": {"xeon-amx": "2-core Intel Xeon with AMX"}, "texts": {"heldout16": "16 windows"}}
    (results / "protocols.json").write_text(json.dumps(protocols))
    (results / "suite.json").write_text(json.dumps({"rows": [{"name": "a", "ood_ratio": 3.0789}]}))
    figure = {"quantity": "perplexity", "protocol": "heldout16"}
    fig_set = {
        "title": "t",  # names the set in its reproduce line
        "model": "m",
        "machine": "xeon-amx",
        "command": "looplm info m",
        "commit": "abc1234",
        "minutes": 1,
        "results": ["../suite.json"],
        "figures": {
            "held": {**figure, "value": "48.78"},
            "ood": {
                "quantity": "ood ratio",
                "protocol": "heldout16",
                "from": "../suite.json",
                "path": ["rows", {"name": "a"}, "ood_ratio"],
                "format": "{:.2f}x",
            },
        },
    }
    (results / "figures" / "hour.json").write_text(json.dumps(fig_set))
    if second_value is not None:
        again = {**fig_set, "figures": {"held_again": {**figure, "value": second_value}}}
        (results / "figures" / "again.json").write_text(json.dumps(again))
    (root / "README.md").write_text(
        f"Healed: <!-- fig hour.held -->{page_value}<!-- /fig --> and <!-- fig hour.ood -->?<!-- /fig -->.\n"
        "<!-- fig hour -->\n<!-- /fig -->\n"
    )


def test_render_fills_the_markers_and_check_lists_what_differs(tmp_path, capsys):
    _tiny_docs(tmp_path, page_value="1.43")
    assert main(["docs", "render", "--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "hour.held: the page has '1.43', its files give '48.78'" in err and "hour.ood" in err
    assert main(["docs", "render", "--root", str(tmp_path)]) == 0
    page = (tmp_path / "README.md").read_text()
    assert "-->48.78<!--" in page and "-->3.08x<!--" in page
    assert (
        "To reproduce t: `looplm info m`. Ran on a 2-core Intel Xeon with AMX in 1 minute (commit `abc1234`)." in page
    )
    assert "[suite.json](docs/results/suite.json)" in page
    assert main(["docs", "render", "--check", "--root", str(tmp_path)]) == 0


def test_a_quantity_given_twice_is_refused(tmp_path, capsys):
    _tiny_docs(tmp_path, page_value="48.78", second_value="49.05")
    assert main(["docs", "render", "--check", "--root", str(tmp_path)]) == 1
    assert "hour.held (48.78)" in capsys.readouterr().err


# --- links and anchors -----------------------------------------------------------------------


def prose(text: str) -> str:
    """The page without its code blocks, code spans and HTML comments, where links are not links."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    text = re.sub(r"<!--.*?-->", "", "\n".join(lines), flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    text = "\n".join(line for line in _outside_code(page.read_text()))
    for line in text.split("\n"):
        m = HEADING.match(line)
        if m:
            base = slug(m[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def _outside_code(text: str):
    fenced = False
    for line in text.split("\n"):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            yield line


def test_anchors_follow_githubs_rule():
    assert slug("Against llama.cpp") == "against-llamacpp"
    assert slug("Speculative decoding: `--speculate`") == "speculative-decoding---speculate"
    assert slug("Sharing plan (prelude / core / coda)") == "sharing-plan-prelude--core--coda"
    assert slug("The paper's claims") == "the-papers-claims"


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no {path})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_every_internal_link_and_anchor_resolves():
    broken = [b for page in pages(ROOT) for b in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


# --- commands ----------------------------------------------------------------------------------


def fenced_commands(page: Path) -> list[str]:
    """Every shell line of the page's code blocks: all lines of bash/sh blocks, and the `$ ` prompts of others
    (transcripts). A backslash at a line's end continues it."""
    commands, language, pending = [], None, ""
    for line in page.read_text().split("\n"):
        m = FENCE.match(line.strip())
        if m:
            language = (m[1] or "text") if language is None else None
            continue
        if language is None:
            continue
        line = pending + line
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if language in ("bash", "sh", "shell") or line.startswith("$ "):
            commands.append(line.removeprefix("$ "))
    return commands


def looplm_argvs(command: str) -> list[list[str]]:
    """The argument lists of the `looplm ...` commands in one shell line (`.venv/bin/looplm`, and `-m looplm`
    under torchrun or accelerate, too). `...` stands for "more flags" and is left out."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens, argvs, segment = list(lexer), [], []
    for token in [*tokens, ";"]:
        if token not in ("&&", "||", ";", "|", "&"):
            segment.append(token)
            continue
        words = [w for w in segment if w != "..."]
        while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
            words.pop(0)
        if words and words[0] in ("looplm", ".venv/bin/looplm"):
            argvs.append(words[1:])
        elif "looplm" in words and words[words.index("looplm") - 1] == "-m":
            argvs.append(words[words.index("looplm") + 1 :])
        segment = []
    return argvs


def documented_commands() -> list[tuple[str, list[str]]]:
    found = [(p.name, c) for p in [ROOT / "README.md", *GUIDES] for c in fenced_commands(p)]
    for fig_set in load_sets(ROOT).values():  # RESULTS' reproducing commands
        cmds = fig_set.data["command"]
        found += [(fig_set.path.name, c) for c in (cmds if isinstance(cmds, list) else [cmds])]
    return [(where, argv) for where, command in found for argv in looplm_argvs(command)]


def test_the_docs_document_commands():
    where = {w for w, _ in documented_commands()}
    assert len(documented_commands()) > 50 and {"README.md", "heal.md", "serve.md", "heal-default-hour.json"} <= where


def test_every_documented_command_parses(capsys):
    parser = build_parser()
    refused = []
    for where, argv in documented_commands():
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            if e.code:
                refused.append(f"{where}: looplm {shlex.join(argv)}\n    {capsys.readouterr().err.strip()[-300:]}")
    capsys.readouterr()
    assert not refused, "documented commands the parser refuses:\n" + "\n".join(refused)


def test_the_command_lines_are_split_as_a_shell_would():
    assert looplm_argvs("looplm convert --lora-rank 128 --out out/b2-r128 && looplm heal out/b2-r128  # one hour") == [
        ["convert", "--lora-rank", "128", "--out", "out/b2-r128"],
        ["heal", "out/b2-r128"],
    ]
    assert looplm_argvs("torchrun --nproc_per_node 2 -m looplm heal out/m --out RUN ...") == [
        ["heal", "out/m", "--out", "RUN"]
    ]
    assert looplm_argvs("PYTHONPATH=src .venv/bin/looplm info m") == [["info", "m"]]
    assert looplm_argvs("bash scripts/quickstart.sh") == []


@pytest.fixture
def tiny_model(tmp_path, one_torch_thread):
    from test_train_fixtures import byte_tokenizer, tiny_vanilla

    from looplm.models import save_model

    return save_model(tiny_vanilla(), byte_tokenizer(), tmp_path / "tiny")


PLAN = re.compile(r"\d+ \+ \d+ x \d+ \+ \d+ \(cycle core\)")


def transcript_shape(lines: list[str]) -> list:
    """Each line's first word (the model path that starts `looplm info`'s first line as MODEL), and whether the
    first line prints the plan as prelude + shared layers x loops + coda."""
    words = ["MODEL:" if i == 0 and line.split()[0].endswith(":") else line.split()[0] for i, line in enumerate(lines)]
    return [*words, bool(PLAN.search(lines[0]))]


def test_cheap_documented_commands_run(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0 and "--sharing" in capsys.readouterr().out
    out = tmp_path / "tiny-b2"
    assert main(["convert", str(tiny_model), "--lora-rank", "4", "--calib-tokens", "256", "--calib-seq-len", "64",
                 "--scored-tokens", "64", "--out", str(out)]) == 0  # fmt: skip
    converted = capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    # the transcripts the guides show have today's shape (convert-default.json and convert-info.json)
    sets = load_sets(ROOT)
    for printed, documented in ((converted, sets["convert-default"]), (info, sets["convert-info"])):
        assert transcript_shape(printed.strip().split("\n")) == transcript_shape(documented.data["output"])
    assert main(["docs", "render", "--check", "--root", str(ROOT)]) == 0


# --- the pages' goals --------------------------------------------------------------------------

USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *GUIDES]


def visible(cell: str) -> str:
    """What a reader sees of a table cell: no comments, links as their text, no emphasis."""
    cell = re.sub(r"<!--.*?-->", "", cell)
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).replace("**", "").strip()


def test_the_readme_answers_in_a_table_of_short_cells():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 100
    assert "```bash\nbash scripts/quickstart.sh\nbash scripts/setup.sh && .venv/bin/ruff check" in readme
    results = readme.split("## Results")[1].split("\n## ")[0]
    rows = [line for line in results.split("\n") if line.startswith("| ") and not line.startswith("| question")]
    assert 4 <= len(rows) <= 8
    for row in rows:
        question, answer, reproduce = [visible(c) for c in row.strip("|").split(" | ")]
        assert len(answer) <= 250, f"{question}: {len(answer)} characters"
        assert re.search(r"Xeon|EPYC", answer), f"{question}: no machine named"
        assert "RESULTS" in reproduce


def test_pages_keep_to_their_size():
    assert len((ROOT / "docs" / "RESULTS.md").read_text().split("\n")) <= 350
    total = sum(len(p.read_bytes()) for p in pages(ROOT))
    assert total <= 150 * 1024, f"README and docs/ hold {total / 1024:.0f} KB of markdown; the goal is 150 KB"


def test_user_pages_give_answers_not_history():
    history = re.compile(r"\b(former|formerly|earlier|issue \d+|sessions?)\b", re.I)
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
        for p in USER_PAGES
        for i, line in enumerate(prose(p.read_text()).split("\n"), 1)
        if history.search(line)
    ]
    assert not found, "history words in user docs (move the story to experiments/INDEX.md):\n" + "\n".join(found)
