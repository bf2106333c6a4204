"""`looplm eval claims`: the paper's claims decided from saved suite results, as one markdown table.

Each claim names two models of a suite (by the NAME of `looplm eval suite NAME=MODEL ...`) and the model the
paper says is better, or (``keeps``) no worse. For the first results file holding both, and every metric the suite
scored (out-of-domain and in-domain perplexity, the seven-task average), the table gives the gap with its paired
standard error, each model's training budget, and the decision: held or not held when the gap is beyond two
standard errors, else "not decided at this budget"; a claim that A keeps B's quality is held unless A is worse
beyond two standard errors. Claims whose models no results file holds read "not run". Nothing is rescored: the
suite's JSON keeps every window's loss and every document's score.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..util import write_text_atomic
from . import stats

CLAIM_METRICS = ("ood", "in_domain", "average")
METRIC_NAMES = {"ood": "out-of-domain log-ppl", "in_domain": "held-out log-ppl", "average": "7-task accuracy"}


@dataclass(frozen=True)
class Claim:
    """The paper says model ``better`` beats model ``worse`` (suite names), or with ``keeps`` that it is no worse."""

    text: str
    better: str
    worse: str
    keeps: bool = False


# Names as experiments/paper_comparison.sh gives them to `looplm eval suite` (healed: -heal, the paper's uptraining:
# -kd); -loop1: the exit after loop 1 (MODEL@1).
CLAIMS = (
    Claim("A recursive model beats a reduced-size model of the same N-emb (healed)", "rec-heal", "reduced-heal"),
    Claim("A recursive model beats a reduced-size model of the same N-emb (uptrained with KD)", "rec-kd", "reduced-kd"),
    Claim("Relaxation (LoRA rank 64) beats the plain recursive model", "rel64-heal", "rec-heal"),
    Claim("A larger LoRA rank moves further toward the original (128 against 64)", "rel128-heal", "rel64-heal"),
    Claim("Stepwise is the best init without LoRA (against Average)", "rec-stepwise-heal", "rec-average-heal"),
    Claim("Average is the best init with LoRA (against Stepwise, SVD rank 64)", "rel64-heal", "rel-stepwise64-heal"),
    Claim("SVD init of the LoRA beats zero init (rank 64)", "rel64-heal", "rel-zero64-heal"),
    Claim("Pretrained init is far better than random", "rec-average-heal", "rec-random-heal"),
    Claim("Relaxation beats the plain recursive model at equal init (Average)", "rel64-heal", "rec-average-heal"),
    Claim("LoRA relaxes better than learned prefixes at equal parameters (healed)", "lora4-heal", "prefix71-heal"),
    Claim(
        "Early-exit post-training keeps the final loop's quality (against the same steps without the exit term)",
        "rec-exit",
        "rec-exitctl",
        keeps=True,
    ),
    Claim(
        "Early-exit post-training raises loop 1's quality (against the same steps without it)",
        "rec-exit-loop1",
        "rec-exitctl-loop1",
    ),
    Claim(
        "Training the body for early exits beats a head-LoRA exit adapter on the frozen body (loop 1, both from "
        "the healed model without its exit adapter)",
        "rec-exitbody-loop1",
        "rec-exitlora-loop1",
    ),
)


def decision(verdict: str, claim: Claim) -> str:
    if claim.keeps:
        return "not held" if verdict == f"{claim.worse} better" else "held (no loss beyond two SE)"
    if verdict == f"{claim.better} better":
        return "held"
    if verdict == f"{claim.worse} better":
        return "not held"
    return "not decided at this budget"


def load_results(paths: list[str | Path]) -> list[tuple[Path, dict]]:
    out = []
    for p in map(Path, paths):
        try:
            result = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(
                f"cannot read suite results {p} ({e}); give the .json `looplm eval suite --out` wrote"
            ) from None
        if "rows" not in result or "domains" not in result:
            raise UsageError(f"{p} is not a `looplm eval suite` result (no rows or domains)")
        if result.get("partial"):
            raise UsageError(f"{p} holds an interrupted suite; finish it with `looplm eval suite ... --resume`")
        for row in result["rows"]:
            row.setdefault("name", row["model"])  # results written before models had names
        out.append((p, result))
    return out


def _number(c: dict) -> str:
    if c["metric"] == "average":
        return f"{100 * c['difference']:+.1f} ± {100 * c['se']:.1f} points"
    return f"{c['difference']:+.4f} ± {c['se']:.4f} ({100 * math.expm1(c['difference']):+.1f}% ppl)"


def decide(
    claims: tuple[Claim, ...], results: list[tuple[Path, dict]], resamples: int = stats.RESAMPLES, seed: int = 0
) -> list[dict]:
    """One entry per claim, original and metric, from the first results file holding both its models (a
    perplexity-only suite of models that a fuller one also scored repeats its figures); one "not run" entry per
    claim that no file holds."""
    out = []
    for claim in claims:
        found, decided = False, set()
        for path, result in results:
            rows = {r["name"]: r for r in result["rows"]}
            if claim.better not in rows or claim.worse not in rows:
                continue
            found = True
            scored = stats.metrics_of(result)
            reference = result["rows"][0]["model"]
            for metric in (m for m in CLAIM_METRICS if m in scored and (reference, m) not in decided):
                decided.add((reference, metric))
                c = stats.compare(result, claim.better, claim.worse, metric, resamples, seed)
                budgets = [rows[n].get("budget") or "as given" for n in (claim.better, claim.worse)]
                out.append(
                    {
                        "claim": claim.text,
                        "better": claim.better,
                        "worse": claim.worse,
                        "reference": reference,
                        "metric": metric,
                        "difference": c["difference"],
                        "se": c["se"],
                        "number": _number(c),
                        "budget": budgets[0] if budgets[0] == budgets[1] else " / ".join(budgets),
                        "decision": decision(c["verdict"], claim),
                        "results": str(path),
                        "command": result.get("reproduce") or result.get("command") or "",
                    }
                )
        if not found:
            out.append({"claim": claim.text, "better": claim.better, "worse": claim.worse, "decision": "not run"})
    return out


def markdown(entries: list[dict], title: str = "The paper's claims") -> str:
    lines = [
        f"# {title}",
        "",
        "| claim | A against B | metric | A - B here ± SE | budget | decision | reproduce |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        pair = f"`{e['better']}` against `{e['worse']}`" + (f" ({e['reference']})" if e.get("reference") else "")
        if e["decision"] == "not run":
            lines.append(f"| {e['claim']} | {pair} | - | - | - | not run | - |")
            continue
        reproduce = f"`{e['command']}` ([results]({e['results']}))" if e["command"] else f"[results]({e['results']})"
        lines.append(
            f"| {e['claim']} | {pair} | {METRIC_NAMES[e['metric']]} | {e['number']} | {e['budget']} | "
            f"**{e['decision']}** | {reproduce} |"
        )
    lines += [
        "",
        "A is the model the paper says is better; in brackets the original both were made from. Perplexity: the "
        "difference in log-perplexity (negative: A lower; out-of-domain, the mean over the suite's domains) with a "
        "paired bootstrap over windows; accuracy: the difference in the seven tasks' mean headline accuracy with the "
        "paired standard error over documents. A claim is held or not held only beyond two standard errors.",
    ]
    return "\n".join(lines) + "\n"


def write_claims(results: list[str | Path], out: str | Path, resamples: int = stats.RESAMPLES, seed: int = 0):
    entries = decide(CLAIMS, load_results(results), resamples, seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, markdown(entries))
    return entries
