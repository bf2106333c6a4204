"""`looplm eval claims`: the paper's claims decided from saved suite results, as one markdown table.

Each claim names two models of a suite (by the NAME of `looplm eval suite NAME=MODEL ...`) and the model the
paper says is better, or (``keeps``) no worse. For the first results file holding both, and every metric the suite
scored (out-of-domain and in-domain perplexity, the seven-task average), the table gives the gap with its paired
standard error, each model's training budget, and the decision: held or not held when the gap is beyond two
standard errors, else "not decided at this budget"; a claim that A keeps B's quality is held unless A is worse
beyond two standard errors. A claim no results file holds for one of the originals it is tested on reads "not
run", with the command that runs it. A claim healed again with other seeds (``seeds``: the suffixes of those
models' names) gets one more row per metric: the gap over the seeds, its error their spread beside the text's
(stats.across_seeds). Nothing is rescored: the suite's JSON keeps every window's loss and every document's score.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..util import write_text_atomic
from . import stats

CLAIM_METRICS = ("ood", "in_domain", "average")
METRIC_NAMES = {"ood": "out-of-domain log-ppl", "in_domain": "held-out log-ppl", "average": "7-task accuracy"}


# the family experiments/paper_comparison.sh names each original by (its FAMILIES)
FAMILIES = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}
HEAL_STEPS = "data convert heal suite claims"


@dataclass(frozen=True)
class Claim:
    """The paper says model ``better`` beats model ``worse`` (suite names), or with ``keeps`` that it is no worse.
    ``runs``: experiments/paper_comparison.sh's settings that make and score both, and ``originals`` the models it
    is tested on (each a "not run" row until a results file holds it). ``seeds``: suffixes of the names of the pair
    healed again with another seed (e.g. "-seed1": ``better``-seed1 against ``worse``-seed1)."""

    text: str
    better: str
    worse: str
    runs: str
    keeps: bool = False
    originals: tuple[str, ...] = ("smollm2-135m",)
    # decided on the second half of the windows and documents, after a choice made on the first (stats.half)
    halves: bool = False
    script: str = "experiments/paper_comparison.sh"
    seeds: tuple[str, ...] = ()

    def command(self, original: str) -> str:
        family = f"FAMILIES={FAMILIES.get(original, original)} " if self.script.endswith("paper_comparison.sh") else ""
        return f"{family}{self.runs} bash {self.script}"


def _students(names: str, steps: str = HEAL_STEPS) -> str:
    return f'STUDENTS="{names}" STEPS="{steps}"'


# Names as experiments/paper_comparison.sh gives them to `looplm eval suite` (healed: -heal, the paper's uptraining:
# -kd); -loop1: the exit after loop 1 (MODEL@1).
EXITS = _students("rec", "data convert heal exits claims")
CLAIMS = (
    Claim(
        "A recursive model beats a reduced-size model of the same N-emb (healed)",
        "rec-heal",
        "reduced-heal",
        _students("rec reduced"),
        originals=("smollm2-135m", "gemma3-270m"),
    ),
    Claim(
        "A recursive model beats a reduced-size model of the same N-emb (healed again, seed 1)",
        "rec-seed1-heal",
        "reduced-seed1-heal",
        _students("rec-seed1 reduced-seed1"),
        originals=("gemma3-270m",),
    ),
    Claim(
        "A recursive model beats a reduced-size model of the same N-emb (uptrained with KD)",
        "rec-kd",
        "reduced-kd",
        _students("rec reduced", "data convert heal kd suite claims"),
    ),
    Claim(
        "Relaxation (LoRA rank 64) beats the plain recursive model", "rel64-heal", "rec-heal", _students("rec rel64")
    ),
    Claim(
        "A larger LoRA rank moves further toward the original (128 against 64)",
        "rel128-heal",
        "rel64-heal",
        _students("rel64 rel128"),
    ),
    Claim(
        "Stepwise is the best init without LoRA (against Average)",
        "rec-stepwise-heal",
        "rec-average-heal",
        _students("rec-stepwise rec-average"),
    ),
    Claim(
        "Average is the best init with LoRA (against Stepwise, SVD rank 64)",
        "rel64-heal",
        "rel-stepwise64-heal",
        _students("rel64 rel-stepwise64"),
    ),
    Claim(
        "SVD init of the LoRA beats zero init (rank 64)", "rel64-heal", "rel-zero64-heal", _students("rel64 rel-zero64")
    ),
    Claim(
        "Pretrained init is far better than random",
        "rec-average-heal",
        "rec-random-heal",
        _students("rec-average rec-random"),
    ),
    Claim(
        "Relaxation beats the plain recursive model at equal init (Average)",
        "rel64-heal",
        "rec-average-heal",
        _students("rel64 rec-average"),
    ),
    Claim(
        "Relaxation beats the plain recursive model at equal init (Stepwise)",
        "rel-stepwise64-heal",
        "rec-stepwise-heal",
        _students("rel-stepwise64 rec-stepwise"),
    ),
    Claim(
        "LoRA relaxes better than learned prefixes at equal parameters (healed)",
        "lora4-heal",
        "prefix71-heal",
        _students("lora4 prefix71"),
    ),
    Claim(
        "Early-exit post-training keeps the final loop's quality (against the same steps without the exit term)",
        "rec-exit",
        "rec-exitctl",
        EXITS,
        keeps=True,
    ),
    Claim(
        "Early-exit post-training raises loop 1's quality (against the same steps without it)",
        "rec-exit-loop1",
        "rec-exitctl-loop1",
        EXITS,
    ),
    Claim(
        "Training the body for early exits beats a head-LoRA exit adapter on the frozen body (loop 1, both from "
        "the healed model without its exit adapter)",
        "rec-exitbody-loop1",
        "rec-exitlora-loop1",
        EXITS,
    ),
)


def _plans(text: str, a: str, b: str, tag: str = "", seeds: tuple[str, ...] = ()) -> Claim:
    """Plan ``a`` against ``b``; with ``tag`` (-mix) both healed on the recipe's corpus, their suite names tagged;
    ``seeds``: both healed again with these seeds too (-seedN students)."""
    runs = f'STUDENTS="{" ".join(f"{a}{s} {b}{s}" for s in ("", *seeds))}"'
    if tag:
        a, b = a + tag, b + tag
        runs += f" HEAL_DATA=out/corpus-smollm2-135m{tag}-512 OUT=out/sharing/smollm2{tag} TAG={tag}"
    return Claim(text, a, b, runs, halves=True, script="experiments/sharing_comparison.sh", seeds=seeds)


# Sharing plans against each other and against the reduced-size model of their own N-emb (SmolLM2-135M, B=2,
# rank 0 unless named; names as experiments/sharing_comparison.sh gives them): chosen on the held-out split and the
# first half of the suite's windows, decided on the second half.
PLAN_CLAIMS = (
    _plans(
        "Middle-cycle (1 + 14 x 2 + 1) beats the reduced-size model of its N-emb (16 layers)",
        *("mc", "reduced16"),
        seeds=("-seed1",),
    ),
    _plans(
        "Middle-cycle beats the reduced-size model of its N-emb, both healed on the recipe's corpus (the original's "
        "own text beside real text)",
        *("mc", "reduced16", "-mix"),
    ),
    _plans("Cycle (15 x 2) beats the reduced-size model of its N-emb (15 layers)", "rec", "reduced15"),
    _plans("3 + 12 x 2 + 3 beats the reduced-size model of its N-emb (18 layers)", "p3c3", "reduced18"),
    _plans("2 + 13 x 2 + 2 beats the reduced-size model of its N-emb (17 layers)", "p2c2", "reduced17"),
    _plans(
        "Middle-cycle beats cycle at equal N-emb (cycle given one layer's parameters as LoRA rank 12)", "mc", "rec-r12"
    ),
    _plans("Middle-cycle beats cycle, both rank 0 (middle-cycle one layer larger)", "mc", "rec"),
    _plans("Middle-cycle at rank 56 beats cycle at rank 64 (equal N-emb, 72.7M)", "mc56", "def"),
    _plans("3 + 12 x 2 + 3 beats middle-cycle, both rank 0", "p3c3", "mc"),
    _plans("A loop scale (Mixture-of-Recursions' per-recursion vector) improves middle-cycle at rank 0", "mcs", "mc"),
    _plans("A magnitude per depth (DoRA's) improves middle-cycle at rank 0", "mcm", "mc"),
    _plans(
        "Middle-cycle with a magnitude per depth beats the reduced-size model of its N-emb (0.3% smaller)",
        *("mcm", "reduced16"),
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


def metric_name(metric: str, result: dict) -> str:
    """The metric as the table names it; held-out perplexity names the sources its windows hold."""
    sources = result.get("in_domain_sources") if metric == "in_domain" else None
    return METRIC_NAMES[metric] + (f" ({', '.join(sources)})" if sources else "")


def _number(c: dict) -> str:
    if c["metric"] == "average":
        return f"{100 * c['difference']:+.1f} ± {100 * c['se']:.1f} points"
    return f"{c['difference']:+.4f} ± {c['se']:.4f} ({100 * math.expm1(c['difference']):+.1f}% ppl)"


def _metrics(claim: Claim, result: dict):
    """(half, the result cut to it, metric) for each metric a claim is decided on: on both halves with ``halves``."""
    for part in stats.HALVES if claim.halves else (None,):
        cut = stats.half(result, part) if part else result
        scored = stats.metrics_of(cut)
        for metric in (m for m in CLAIM_METRICS if m in scored):
            yield part, cut, metric


def _entry(claim: Claim, reference: str, part, metric: str, name: str, c: dict, budget: str, path, command) -> dict:
    """A decided row: ``c`` holds the gap A - B (difference, se) and its verdict."""
    return {
        "claim": claim.text,
        "better": claim.better,
        "worse": claim.worse,
        "reference": reference,
        "metric": metric,
        "half": part,
        "metric_name": name + (f", {part} half" if part else ""),
        "difference": c["difference"],
        "se": c["se"],
        "number": _number({"metric": metric, **c}),
        "budget": budget,
        "decision": decision(c["verdict"], claim) + (" (chooses)" if part == "select" else ""),
        "results": str(path),
        "command": command,
    }


def decide(
    claims: tuple[Claim, ...], results: list[tuple[Path, dict]], resamples: int = stats.RESAMPLES, seed: int = 0
) -> list[dict]:
    """One entry per claim, original and metric, from the first results file holding both its models (a
    perplexity-only suite of models that a fuller one also scored repeats its figures); one "not run" entry, with
    the command that runs it, per original of the claim that no file holds it for."""
    out = []
    for claim in claims:
        found, decided = set(), set()
        for path, result in results:
            rows = {r["name"]: r for r in result["rows"]}
            if claim.better not in rows or claim.worse not in rows:
                continue
            reference = result["rows"][0]["model"]
            found.add(reference)
            budgets = [rows[n].get("budget") or "as given" for n in (claim.better, claim.worse)]
            budget = budgets[0] if budgets[0] == budgets[1] else " / ".join(budgets)
            command = result.get("reproduce") or result.get("command") or ""
            for part, cut, metric in _metrics(claim, result):
                if (reference, part, metric) in decided:
                    continue
                decided.add((reference, part, metric))
                c = stats.compare(cut, claim.better, claim.worse, metric, resamples, seed)
                name = metric_name(metric, result)
                out.append(_entry(claim, reference, part, metric, name, c, budget, path, command))
        out += _across_seeds(claim, results, resamples, seed)
        for original in (o for o in claim.originals if o not in found):
            out.append(
                {
                    "claim": claim.text,
                    "better": claim.better,
                    "worse": claim.worse,
                    "reference": original,
                    "decision": "not run",
                    "command": claim.command(original),
                }
            )
    return out


def _across_seeds(claim: Claim, results: list[tuple[Path, dict]], resamples: int, seed: int) -> list[dict]:
    """With ``claim.seeds``: for every metric (and half) that two or more seeds' pairs were scored on, the gap over
    the seeds with the seeds' spread in its error; each seed's pair is read from the first file holding it."""
    gaps: dict[tuple, list[dict]] = {}
    for suffix in ("", *claim.seeds):
        a, b = claim.better + suffix, claim.worse + suffix
        held = next(((p, r) for p, r in results if {a, b} <= {row["name"] for row in r["rows"]}), None)
        if held is None:
            continue
        path, result = held
        reference, budget = result["rows"][0]["model"], stats.row_by_name(result["rows"], a).get("budget")
        for part, cut, metric in _metrics(claim, result):
            c = stats.compare(cut, a, b, metric, resamples, seed)
            seen = {"gap": (c["difference"], c["se"]), "path": path, "result": result, "budget": budget}
            gaps.setdefault((reference, part, metric), []).append(seen)
    out = []
    for (reference, part, metric), got in gaps.items():
        if len(got) < 2:
            continue
        difference, se = stats.across_seeds([g["gap"] for g in got])
        verdict = stats.verdict(difference, se, claim.better, claim.worse, lower_is_better=metric != "average")
        c = {"difference": difference, "se": se, "verdict": verdict}
        name = metric_name(metric, got[0]["result"]) + f", over {len(got)} seeds"
        budget = " / ".join(sorted({g["budget"] or "as given" for g in got}))
        entry = _entry(claim, reference, part, metric, name, c, budget, got[-1]["path"], claim.command(reference))
        out.append({**entry, "seeds": len(got)})
    return out


def markdown(entries: list[dict], title: str = "The paper's claims", base: str | Path | None = None) -> str:
    """The claims table; links to results files are relative to ``base``, the folder the table is written to
    (None: as the entries name them)."""
    lines = [
        f"# {title}",
        "",
        "| claim | A against B | metric | A - B here ± SE | budget | decision | reproduce |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        pair = f"`{e['better']}` against `{e['worse']}`" + (f" ({e['reference']})" if e.get("reference") else "")
        if e["decision"] == "not run":
            lines.append(f"| {e['claim']} | {pair} | - | - | - | not run | `{e['command']}` |")
            continue
        link = Path(os.path.relpath(e["results"], base)).as_posix() if base is not None else e["results"]
        reproduce = f"`{e['command']}` ([results]({link}))" if e["command"] else f"[results]({link})"
        lines.append(
            f"| {e['claim']} | {pair} | {e['metric_name']} | {e['number']} | {e['budget']} | "
            f"**{e['decision']}** | {reproduce} |"
        )
    if any(e.get("half") for e in entries):
        lines += [
            "",
            "Each pair is compared on two halves: the held-out split and the first half of every out-of-domain "
            "domain's windows and every task's documents choose (rows marked \"chooses\"); the second half, which "
            "the choice never saw, decides.",
        ]
    if any(e.get("seeds") for e in entries):
        lines += [
            "",
            'Rows "over N seeds": the pair healed with N seeds, scored on the same text; the gap is the seeds\' '
            "mean, and its error adds their spread to the text's.",
        ]
    lines += [
        "",
        "A is the model the paper says is better; in brackets the original both were made from. Perplexity: the "
        "difference in log-perplexity (negative: A lower; out-of-domain, the mean over the suite's domains) with a "
        "paired bootstrap over windows; accuracy: the difference in the seven tasks' mean headline accuracy with the "
        "paired standard error over documents. A claim is held or not held only beyond two standard errors.",
    ]
    return "\n".join(lines) + "\n"


def write_claims(
    results: list[str | Path], out: str | Path, resamples: int = stats.RESAMPLES, seed: int = 0, plans: bool = False
):
    """The paper's claims table, or with ``plans`` the sharing plans' (PLAN_CLAIMS), into ``out``."""
    entries = decide(PLAN_CLAIMS if plans else CLAIMS, load_results(results), resamples, seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = "Sharing plans compared" if plans else "The paper's claims"
    write_text_atomic(out, markdown(entries, title, base=out.parent))
    return entries
