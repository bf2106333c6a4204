"""`looplm eval suite`: the original and any number of converted or healed models in one table.

For each model: perplexity on every out-of-domain domain (data/ood.py), their geometric mean against the
first model's (the reference, normally the original), optionally the held-out split of a training corpus
(in-domain), and few-shot accuracy (LAMBADA and the paper's seven-task average) through lm-evaluation-harness.
Every figure is the final exit's, or loop i's for a model given as ``MODEL@i`` (a static exit after loop i).

Every model is scored on the same windows and task documents, and the result keeps each window's mean token loss
and each document's score: the ratios carry a paired-bootstrap standard error and 95% interval, and pairs of
models are compared beyond two standard errors (looplm.eval.stats), now or later from the JSON alone
(`looplm eval claims`).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from ..data.ood import domain_windows, geometric_ratio, parse_domains
from ..errors import UsageError
from ..util import read_jsonl, write_json_atomic, write_text_atomic
from . import stats

LABEL = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.+-]*)=(.+)$")
EXIT = re.compile(r"^(.+)@([0-9]+)$")


def score_model(
    model,
    tok,
    domains: list[str],
    windows: int,
    seq_len: int,
    corpus=None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 4,
    progress: bool = False,
    exit_loop: int | None = None,
) -> dict:
    """One model's row, every figure at the exit after loop ``exit_loop`` (default: the last): {"ood": {domain:
    perplexity}, "ood_windows": {domain: {"loss", "tokens"}}, "in_domain" and "in_domain_windows" (with a corpus),
    "tasks": {task: {value, stderr, n, docs: {ids, correct}}}, "average"}."""
    from .perplexity import score_windows

    add_bos = bool(getattr(model.config, "add_bos_token", False))
    row: dict = {"ood": {}, "ood_tokens": 0, "ood_windows": {}}
    for name, wins in domain_windows(tok, domains, windows, seq_len, add_bos).items():
        r = score_windows(
            model, tok, wins, batch_size, exit_loop, final_only=True, progress=progress, desc=f"perplexity: {name}"
        )
        row["ood"][name] = r["perplexity"]
        row["ood_tokens"] += r["tokens"]
        row["ood_windows"][name] = {"loss": r["window_losses"], "tokens": r["window_tokens"]}
    if corpus is not None:
        held = corpus.splits["heldout"][:windows, :seq_len]
        held = [list(map(int, w)) for w in held]
        r = score_windows(
            model, tok, held, batch_size, exit_loop, final_only=True, progress=progress, desc="perplexity: held out"
        )
        row["in_domain"], row["in_domain_tokens"] = r["perplexity"], r["tokens"]
        row["in_domain_windows"] = {"loss": r["window_losses"], "tokens": r["window_tokens"]}
    if tasks:
        from .fewshot import run_fewshot
        from .tasks import PAPER7

        res = run_fewshot(
            model, tok, tasks, limit=limit, exit_loop=exit_loop, batch_size=16, log_samples=True, progress=progress
        )
        row["tasks"] = {
            name: {
                "value": r["value"],
                "stderr": r["stderr"],
                "n": r["n"],
                "docs": document_scores(res["samples"][name], PAPER7[name][1]),
            }
            for name, r in res["tasks"].items()
        }
        row["average"] = res["average"] if len(tasks) > 1 else None
        errors = [r["stderr"] for r in row["tasks"].values()]
        # the tasks' documents are independent: the average's variance is the mean of the tasks' variances / tasks
        row["average_stderr"] = (
            (sum(e * e for e in errors) ** 0.5 / len(errors)) if len(tasks) > 1 and None not in errors else None
        )
    return row


def document_scores(samples: list[dict], metric: str) -> dict:
    """{"ids": [document id], "correct": [the headline metric's per-document score]} of one task."""
    return {"ids": [int(s["doc_id"]) for s in samples], "correct": [float(s[metric]) for s in samples]}


def parse_spec(spec: str) -> tuple[str, str]:
    """``NAME=MODEL`` -> (NAME, MODEL); a bare MODEL is its own name."""
    m = LABEL.match(spec)
    if m and not Path(spec).exists():
        return m.group(1), m.group(2)
    return spec, spec


def split_exit(spec: str) -> tuple[str, int | None]:
    """``MODEL@i`` -> (MODEL, i): the model exiting after loop i; a bare MODEL -> (MODEL, None), its last loop's."""
    m = EXIT.match(spec)
    if m and not Path(spec).exists():
        return m.group(1), int(m.group(2))
    return spec, None


def run_budget(spec: str) -> str | None:
    """What training the model had, from the run directory it is the ``final/`` of: `looplm heal`'s heal.json or
    `looplm train`'s metrics, its minutes with the machines they were spent on (run.json); None for a model that
    is no run's output (e.g. the original)."""
    run = Path(spec).parent  # eval reads the run directory's files itself: it does not import train
    if not Path(spec).is_dir() or not (run / "run.json").exists():
        return None
    machines = json.loads((run / "run.json").read_text()).get("machines")
    on = f" on {', then '.join(machines)}" if machines else ""
    heal = run / "heal.json"
    if heal.exists():
        h = json.loads(heal.read_text())
        return f"heal: {h['tokens']:,} end-to-end + {h['local_tokens']:,} local tokens, {h['minutes']} min{on}"
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if not r.get("eval") and r.get("tokens") is not None]
    if not steps:
        return None
    minutes = f", {steps[-1]['time'] / 60:.2f} min" if "time" in steps[-1] else ""
    return f"uptrain: {steps[-1]['tokens']:,} tokens{minutes}{on}"


def heal_tokens(spec: str) -> int | None:
    """The tokens `looplm heal` trained the model on, in the unit of its ``--train-tokens``: the end-to-end stages'
    tokens plus the layer-local tokens of one shared layer; None for a model that is no heal's ``final/``."""
    run = Path(spec).parent
    if not (run / "heal.json").exists() or not (run / "run.json").exists():
        return None
    plan = json.loads((run / "run.json").read_text()).get("plan") or {}
    return json.loads((run / "heal.json").read_text())["tokens"] + int(plan.get("local_tokens_per_layer", 0))


def run_suite(
    specs: list[str],
    domains: str | None = None,
    windows: int = 16,
    seq_len: int = 512,
    data: str | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 4,
    compare: list[tuple[str, str]] | None = None,
    resamples: int = stats.RESAMPLES,
    seed: int = stats.SEED,
    out: str | Path | None = None,
    resume: bool = False,
    log=print,
    progress: bool = False,
) -> dict:
    """Score every model (``specs``: MODEL or NAME=MODEL, the reference first) and compare them: each ratio with
    its standard error and interval, and ``compare``'s pairs of names (default: the first non-reference model
    against every later one) on every metric scored.

    ``out``: OUT.json keeps the rows scored so far, saved after each model; with ``resume`` a row it already holds
    (the same name and model, scored with the same ``settings``) is kept instead of scored again. ``progress``: a
    bar per domain and per task on stderr."""
    if resume and out is None:
        raise UsageError("--resume continues the result in --out: give --out too")
    names = parse_domains(domains)
    corpus = _heldout_corpus(data)
    labelled = _labelled_specs(specs, compare)
    score = {
        "domains": names,
        "windows": windows,
        "seq_len": seq_len,
        "corpus": corpus,
        "tasks": tasks,
        "limit": limit,
        "batch_size": batch_size,
        "progress": progress,
    }
    expected = settings(names, windows, seq_len, data, tasks, limit)
    js = Path(out).with_suffix(".json") if out is not None else None
    earlier = {(r["name"], r["model"]): r for r in earlier_rows(js, expected) if r.get("tokenizer")} if resume else {}
    rows = _score_rows(labelled, earlier, data, score, _partial_saver(js, expected), log)
    _add_ratios(rows)
    result = {
        "reference": rows[0]["name"],
        **expected,
        # the text the held-out figures are measured on
        **({"in_domain_sources": corpus.sources_of("heldout", windows)} if corpus is not None else {}),
        "rows": rows,
        "resamples": resamples,
        "seed": seed,
    }
    stats.add_perplexity_intervals(result, resamples, seed)
    pairs = stats.default_pairs(result) if compare is None else compare
    result["comparisons"] = stats.comparisons(result, pairs, resamples, seed)
    return result


def _partial_saver(js: Path | None, expected: dict):
    """``save(rows)``: OUT.json with the rows scored so far, after each model, so that a resume goes on from it; None
    without an OUT."""
    if js is None:
        return None

    def save(rows: list[dict]) -> None:
        js.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(js, {**expected, "partial": True, "rows": rows})

    return save


def _heldout_corpus(data: str | None):
    """The corpus ``data`` whose held-out split the in-domain figures read; None without one."""
    if not data:
        return None
    from ..data.corpus import PackedCorpus

    corpus = PackedCorpus(data)
    if len(corpus.splits["heldout"]) == 0:
        raise UsageError(f"the corpus {data} has no held-out split to score in-domain text on")
    return corpus


def _labelled_specs(specs: list[str], compare: list[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """[(NAME, MODEL)] of ``specs``, refusing two models of one name and ``compare`` pairs naming no model."""
    labelled = [parse_spec(s) for s in specs]
    seen = [n for n, _ in labelled]
    if len(set(seen)) != len(seen):
        raise UsageError(f"two models share a name in {', '.join(seen)}; give each its own NAME=MODEL")
    models = [s for _, s in labelled]
    unknown = [n for pair in compare or [] for n in pair if n not in seen and n not in models]
    if unknown:
        raise UsageError(f"--compare names {', '.join(unknown)}, not a model of this suite ({', '.join(seen)})")
    return labelled


def _score_rows(
    labelled: list[tuple[str, str]], earlier: dict, data: str | None, score: dict, on_row, log
) -> list[dict]:
    """Each model's row in turn, an ``earlier`` row of the same name and model kept; every model must share the
    reference's (the first's) tokenizer."""
    first = labelled[0][1]  # the reference's model, which the errors name
    rows, reference_fp = [], None
    for label, spec in labelled:
        if (label, spec) in earlier:
            row = earlier[(label, spec)]
            reference_fp = reference_fp or row["tokenizer"]
            if row["tokenizer"] != reference_fp:
                raise UsageError(f"{spec} uses another tokenizer than {first}: evaluate one family in one table")
            rows.append(row)
            log(f"{label}: scored before, kept")
            continue
        log(f"{label}: scoring {spec}")
        row = _scored_row(label, spec, reference_fp, first, data, score)
        if reference_fp is None:
            reference_fp = row["tokenizer"]
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        log(
            f"{label}: out-of-domain "
            + ", ".join(f"{n} {p:.2f}" for n, p in row["ood"].items())
            + (f"; in-domain {row['in_domain']:.2f}" if "in_domain" in row else "")
            + f" ({row['seconds']} s)"
        )
    return rows


def _scored_row(label: str, spec: str, reference_fp: str | None, first: str, data: str | None, score: dict) -> dict:
    """Load and score one model (``score``: score_model's settings); its row, timed. ``reference_fp``: the
    reference's tokenizer fingerprint (None for the reference itself), which the model's must equal."""
    from ..convert.recursive import count_parameters
    from ..models import load_model
    from ..models.loading import tokenizer_fingerprint

    t0 = time.perf_counter()
    path, exit_loop = split_exit(spec)
    model, tok = load_model(path)
    try:
        exit_loop = model.model.check_loops(exit_loop)
    except ValueError as e:
        raise UsageError(f"{spec}: {e}") from None
    if tok is None:
        raise UsageError(f"{spec} has no tokenizer files; save the model with its tokenizer")
    fp = tokenizer_fingerprint(tok)
    if reference_fp is not None and fp != reference_fp:
        raise UsageError(
            f"{spec} uses another tokenizer than {first}: per-token perplexities would not "
            f"compare; evaluate models of one family in one table"
        )
    corpus = score["corpus"]
    if corpus is not None and corpus.tokenizer != fp:
        raise UsageError(
            f"the corpus {data} was tokenised for another model; build one with `looplm data build {first}`"
        )
    row = {
        "name": label,
        "model": spec,
        "loops": model.config.num_loops,
        "exit_loop": exit_loop,
        "n_emb": count_parameters(model)["n_emb"],
        "budget": run_budget(path),
        "heal_tokens": heal_tokens(path),
        "tokenizer": fp,
        **score_model(model.eval(), tok, exit_loop=exit_loop, **score),
    }
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _add_ratios(rows: list[dict]) -> None:
    """Each row's perplexities as ratios to the first row's (the reference)."""
    ref = rows[0]
    for row in rows:
        row["ood_ratio"] = geometric_ratio(row["ood"], ref["ood"])
        if "in_domain" in row:
            row["in_domain_ratio"] = row["in_domain"] / ref["in_domain"]


def settings(domains: list[str], windows: int, seq_len: int, data, tasks, limit) -> dict:
    """What decides a suite's figures besides the models: rows scored under other settings do not compare. The
    in-domain corpus is named by its held-out split's checksum too, so that a result resumed on another machine,
    whose corpus was built again, refuses one that came out different."""
    heldout = None
    if data:
        from ..data.corpus import PackedCorpus

        heldout = PackedCorpus(data).meta["splits"].get("heldout", {}).get("sha256")
    return {
        "domains": domains,
        "windows": windows,
        "seq_len": seq_len,
        "data": data,
        "data_heldout_sha256": heldout,
        "tasks": tasks,
        "limit": limit,
    }


def earlier_rows(path: str | Path, expected: dict) -> list[dict]:
    """The rows of an earlier (possibly partial) result at ``path`` scored with ``expected`` settings; none when
    there is no such file."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return []  # a file cut short: score everything again
    differ = [k for k, v in expected.items() if old.get(k) != v]
    if differ:
        raise UsageError(
            f"{path} was scored with other settings ({', '.join(f'{k} {old.get(k)!r}' for k in differ)}); give "
            f"the same settings to resume it, or another --out"
        )
    return old.get("rows", [])


def _ratio(row: dict, key: str) -> str:
    """A ratio with its bootstrap interval, e.g. 1.234x [1.10, 1.38]."""
    st = row.get(f"{key}_ratio_stats")
    text = f"{row[f'{key}_ratio']:.3f}x"
    return text + (f" [{st['ratio_low']:.3f}, {st['ratio_high']:.3f}]" if st else "")


def _difference(c: dict) -> str:
    if c["metric"] in ("ood", "in_domain"):
        return f"{c['difference']:+.4f} ± {c['se']:.4f} log-ppl"
    return f"{100 * c['difference']:+.1f} ± {100 * c['se']:.1f} points"


def markdown(result: dict) -> str:
    """The suite as a markdown table: one row per model, ratios against the first with their 95% intervals; then
    the paired comparisons."""
    names = result["domains"]
    has_in = any("in_domain" in r for r in result["rows"])
    tasks = result.get("tasks") or []
    head = ["model", "N-emb"] + names + ["out-of-domain (x ref)"] + (["in-domain (x ref)"] if has_in else [])
    head += [f"{t} acc" for t in tasks if t == "lambada"] + (["7-task avg"] if len(tasks) > 1 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        n_emb = f"{r['n_emb'] / 1e6:.1f}M" if r.get("n_emb") else "-"
        name = r.get("name", r["model"])
        cells = [f"`{name}`", n_emb] + [f"{r['ood'][n]:.2f}" for n in names] + [_ratio(r, "ood")]
        if has_in:
            cells.append(f"{r['in_domain']:.2f} ({_ratio(r, 'in_domain')})" if "in_domain" in r else "")
        if "lambada" in tasks:
            t = r["tasks"]["lambada"]
            cells.append(f"{100 * t['value']:.1f}" + (f" ± {100 * t['stderr']:.1f}" if t["stderr"] else ""))
        if len(tasks) > 1:
            se = r.get("average_stderr")
            cells.append(f"{100 * r['average']:.1f}" + (f" ± {100 * se:.1f}" if se else ""))
        lines.append("| " + " | ".join(cells) + " |")
    ref = result["rows"][0].get("name", result["rows"][0]["model"])
    lines.append(
        f"\nPerplexity of the final exit on the first {result['windows']} windows of "
        f"{result['seq_len']} tokens of each domain; ratios are geometric means against `{ref}`"
        + (f"; in-domain: {heldout_text(result)}" if has_in else "")
        + (f"; tasks: first {result['limit']} documents each" if tasks and result["limit"] else "")
        + (
            f". Brackets: 95% paired-bootstrap interval over windows ({result['resamples']} resamples, seed "
            f"{result['seed']})."
            if "resamples" in result
            else "."
        )
    )
    if len(tasks) > 1:
        lines += ["", *task_table(result)]
    if result.get("comparisons"):
        lines += [
            "",
            "| A | B | metric | A - B | verdict |",
            "|---|---|---|---|---|",
        ]
        for c in result["comparisons"]:
            lines.append(f"| `{c['a']}` | `{c['b']}` | {c['metric']} | {_difference(c)} | {c['verdict']} |")
        lines.append(
            "\nA - B: the difference in log-perplexity (lower is better; out-of-domain: the mean over domains) or in "
            "accuracy, ± its paired standard error; a verdict names the better model only beyond two standard errors."
        )
    return "\n".join(lines) + "\n"


def heldout_text(result: dict) -> str:
    """What the in-domain figures read, e.g. "the first 32 windows of the held-out split of DIR (austen 32)"."""
    sources = result.get("in_domain_sources")
    held = f" ({', '.join(f'{name} {n}' for name, n in sources.items())})" if sources else ""
    n = sum(sources.values()) if sources else result["windows"]  # fewer when the split is shorter
    return f"the first {n} windows of the held-out split of {result['data']}{held}"


def task_table(result: dict) -> list[str]:
    """Each task's headline accuracy ± its standard error, one row per model."""
    from .report import TASK_HEAD

    tasks = result["tasks"]
    lines = [
        "| model | " + " | ".join(TASK_HEAD.get(t, t) for t in tasks) + " | avg |",
        "|" + "---|" * (len(tasks) + 2),
    ]
    for r in result["rows"]:
        cells = []
        for t in (r["tasks"][t] for t in tasks):
            cells.append(f"{100 * t['value']:.1f}" + (f" ± {100 * t['stderr']:.1f}" if t["stderr"] else ""))
        se = r.get("average_stderr")
        cells.append(f"{100 * r['average']:.1f}" + (f" ± {100 * se:.1f}" if se else ""))
        lines.append(f"| `{r.get('name', r['model'])}` | " + " | ".join(cells) + " |")
    return lines


def plot(result: dict, path: Path) -> Path | None:
    """Quality against N-emb (the shape of the paper's Figure 1): the out-of-domain ratio to the reference with
    its 95% interval, and the tasks' average accuracy ± one standard error when the suite scored several."""
    rows = [r for r in result["rows"] if r.get("n_emb")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = len(result.get("tasks") or []) > 1
    fig, axes = plt.subplots(
        1, 2 if tasks else 1, figsize=(12.5 if tasks else 7.5, 4.5), squeeze=False, layout="constrained"
    )
    # one legend, not a label beside each point: models of the same N-emb sit on top of each other
    styles = [{"color": f"C{i % 10}", "marker": "osD^v"[i // 10 % 5]} for i in range(len(rows))]
    x = [r["n_emb"] / 1e6 for r in rows]
    ax = axes[0][0]
    for xi, r, style in zip(x, rows, styles):
        st = r.get("ood_ratio_stats") or {"ratio_low": r["ood_ratio"], "ratio_high": r["ood_ratio"]}
        err = [[r["ood_ratio"] - st["ratio_low"]], [st["ratio_high"] - r["ood_ratio"]]]
        ax.errorbar([xi], [r["ood_ratio"]], yerr=err, ls="none", capsize=3, label=r.get("name", r["model"]), **style)
    ax.set_yscale("log")
    ax.set_ylabel("out-of-domain perplexity (x the reference)")
    if tasks:
        ax2 = axes[0][1]
        for xi, r, style in zip(x, rows, styles):
            se = 100 * (r.get("average_stderr") or 0)
            ax2.errorbar([xi], [100 * r["average"]], yerr=[se], ls="none", capsize=3, **style)
        ax2.set_ylabel("average task accuracy (%)")
    for a in axes[0]:
        a.set_xlabel("non-embedding parameters (M)")
        a.grid(alpha=0.3)
    fig.legend(loc="outside right center", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save(result: dict, out: str | Path) -> tuple[Path, Path]:
    """OUT.json (every figure, the per-window losses and per-document scores included), OUT.md (the tables) and
    OUT.png (quality against N-emb)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    js = out.with_suffix(".json")
    md = out.with_suffix(".md")
    write_json_atomic(js, result)
    write_text_atomic(md, markdown(result))
    plot(result, out.with_suffix(".png"))
    return js, md
