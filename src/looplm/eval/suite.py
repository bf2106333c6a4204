"""`looplm eval suite`: the original and any number of converted or healed models in one table.

For each model: perplexity on every out-of-domain domain (data/ood.py), their geometric mean against the
first model's (the reference, normally the original), optionally the held-out split of a training corpus
(in-domain), and few-shot accuracy (LAMBADA and the paper's seven-task average) through lm-evaluation-harness.
Every figure is the final exit's.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..data.ood import domain_windows, geometric_ratio, parse_domains
from ..errors import UsageError
from ..util import write_json_atomic, write_text_atomic


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
) -> dict:
    """One model's row: {"ood": {domain: perplexity}, "in_domain": perplexity or None, "tasks": {...}, "average"}."""
    from .perplexity import score_windows

    add_bos = bool(getattr(model.config, "add_bos_token", False))
    row: dict = {"ood": {}, "ood_tokens": 0}
    for name, wins in domain_windows(tok, domains, windows, seq_len, add_bos).items():
        r = score_windows(model, tok, wins, batch_size=batch_size, progress=False)
        row["ood"][name] = r["perplexity"]
        row["ood_tokens"] += r["tokens"]
    if corpus is not None:
        held = corpus.splits["heldout"][:windows, :seq_len]
        r = score_windows(model, tok, [list(map(int, w)) for w in held], batch_size=batch_size, progress=False)
        row["in_domain"], row["in_domain_tokens"] = r["perplexity"], r["tokens"]
    if tasks:
        from .fewshot import run_fewshot

        res = run_fewshot(model, tok, tasks, limit=limit, batch_size=16, progress=progress)
        row["tasks"] = {
            name: {"value": r["value"], "stderr": r["stderr"], "n": r["n"]} for name, r in res["tasks"].items()
        }
        row["average"] = res["average"] if len(tasks) > 1 else None
    return row


def run_suite(
    specs: list[str],
    domains: str | None = None,
    windows: int = 16,
    seq_len: int = 512,
    data: str | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    batch_size: int = 4,
    log=print,
) -> dict:
    from ..models import load_model
    from ..models.loading import tokenizer_fingerprint

    names = parse_domains(domains)
    corpus = None
    if data:
        from ..data.corpus import PackedCorpus

        corpus = PackedCorpus(data)
        if len(corpus.splits["heldout"]) == 0:
            raise UsageError(f"the corpus {data} has no held-out split to score in-domain text on")
    rows, reference_fp = [], None
    for spec in specs:
        t0 = time.perf_counter()
        model, tok = load_model(spec)
        if tok is None:
            raise UsageError(f"{spec} has no tokenizer files; save the model with its tokenizer")
        fp = tokenizer_fingerprint(tok)
        if reference_fp is None:
            reference_fp = fp
        elif fp != reference_fp:
            raise UsageError(
                f"{spec} uses another tokenizer than {specs[0]}: per-token perplexities would not "
                f"compare; evaluate models of one family in one table"
            )
        if corpus is not None and corpus.tokenizer != fp:
            raise UsageError(
                f"the corpus {data} was tokenised for another model; build one with `looplm data build {specs[0]}`"
            )
        row = {
            "model": spec,
            "loops": model.config.num_loops,
            **score_model(model.eval(), tok, names, windows, seq_len, corpus, tasks, limit, batch_size),
        }
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        log(
            f"{spec}: out-of-domain "
            + ", ".join(f"{n} {p:.2f}" for n, p in row["ood"].items())
            + (f"; in-domain {row['in_domain']:.2f}" if "in_domain" in row else "")
            + f" ({row['seconds']} s)"
        )
        del model
    ref = rows[0]
    for row in rows:
        row["ood_ratio"] = geometric_ratio(row["ood"], ref["ood"])
        if "in_domain" in row:
            row["in_domain_ratio"] = row["in_domain"] / ref["in_domain"]
    return {
        "reference": ref["model"],
        "domains": names,
        "windows": windows,
        "seq_len": seq_len,
        "data": data,
        "tasks": tasks,
        "limit": limit,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """The suite as a markdown table: one row per model, ratios against the first."""
    names = result["domains"]
    has_in = any("in_domain" in r for r in result["rows"])
    tasks = result.get("tasks") or []
    head = ["model"] + names + ["out-of-domain (x ref)"] + (["in-domain (x ref)"] if has_in else [])
    head += [f"{t} acc" for t in tasks if t == "lambada"] + (["7-task avg"] if len(tasks) > 1 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [f"`{r['model']}`"] + [f"{r['ood'][n]:.2f}" for n in names] + [f"{r['ood_ratio']:.3f}x"]
        if has_in:
            cells.append(f"{r['in_domain']:.2f} ({r['in_domain_ratio']:.3f}x)" if "in_domain" in r else "")
        if "lambada" in tasks:
            t = r["tasks"]["lambada"]
            cells.append(f"{100 * t['value']:.1f}" + (f" ± {100 * t['stderr']:.1f}" if t["stderr"] else ""))
        if len(tasks) > 1:
            cells.append(f"{100 * r['average']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    ref = result["rows"][0]["model"]
    return "\n".join(lines) + (
        f"\n\nPerplexity of the final exit on the first {result['windows']} windows of "
        f"{result['seq_len']} tokens of each domain; ratios are geometric means against `{ref}`"
        + (f"; in-domain: the held-out split of {result['data']}" if has_in else "")
        + (f"; tasks: first {result['limit']} documents each" if tasks and result["limit"] else "")
        + ".\n"
    )


def save(result: dict, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    js = out.with_suffix(".json")
    md = out.with_suffix(".md")
    write_json_atomic(js, result)
    write_text_atomic(md, markdown(result))
    return js, md
