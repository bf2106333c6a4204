"""Standard errors and paired decisions for `looplm eval suite` and `looplm eval claims`.

Every model of a suite is scored on the same windows of text and the same task documents, so two models are
compared pair-wise: a bootstrap resamples windows (within each domain) or documents, and the same resample is
applied to every model. A gap is decided only beyond two standard errors; inside them it is "not decided".

Perplexity figures work on log-perplexity: a domain's log-perplexity is its summed token loss over its scored
tokens, the out-of-domain figure is the mean over domains of the log-ratio to the reference (the geometric-mean
ratio's log), and in-domain is the held-out split's log-ratio.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError

RESAMPLES = 2000
SEED = 0
SIGMAS = 2.0  # a gap is decided beyond this many standard errors


def window_arrays(windows: dict) -> tuple[np.ndarray, np.ndarray]:
    """(summed token loss, tokens) per window, from a row's {"loss": [mean token loss], "tokens": [count]}."""
    tokens = np.asarray(windows["tokens"], dtype=np.float64)
    return np.asarray(windows["loss"], dtype=np.float64) * tokens, tokens


def resample_indices(n: int, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """[resamples, n] indices drawn with replacement; row 0 is the sample itself, so that the point estimate
    and its resamples come from one code path."""
    idx = rng.integers(0, n, size=(resamples + 1, n))
    idx[0] = np.arange(n)
    return idx


def log_ppl_resamples(groups: list[dict], resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, np.ndarray]:
    """Per group (a domain, or the held-out split): log-perplexity of every model under the same window
    resamples. ``groups``: {group name: {model name: {"loss", "tokens"}}}. Returns {group: [models, resamples + 1]}
    in the models' order, column 0 the unresampled figure."""
    rng = np.random.default_rng(seed)
    out = {}
    for group, per_model in groups.items():
        counts = {len(w["tokens"]) for w in per_model.values()}
        if len(counts) != 1:
            raise UsageError(
                f"the models scored different numbers of windows of {group} ({sorted(counts)}); score them in one "
                f"suite, with the same --windows and --seq-len"
            )
        idx = resample_indices(counts.pop(), resamples, rng)
        rows = []
        for w in per_model.values():
            nll, tokens = window_arrays(w)
            rows.append(nll[idx].sum(1) / tokens[idx].sum(1))
        out[group] = np.stack(rows)
    return out


def summary(samples: np.ndarray) -> dict:
    """Point estimate (column 0), bootstrap standard error and 95% percentile interval of a log figure, each
    also as a ratio (exp)."""
    point, boot = float(samples[0]), samples[1:]
    se = float(boot.std(ddof=1)) if len(boot) > 1 else math.nan
    low, high = np.percentile(boot, [2.5, 97.5]) if len(boot) else (math.nan, math.nan)
    return {
        "log": point,
        "log_se": se,
        "ratio": math.exp(point),
        "ratio_low": float(math.exp(low)),
        "ratio_high": float(math.exp(high)),
    }


def verdict(difference: float, se: float, a: str, b: str, lower_is_better: bool) -> str:
    """ "A better" / "B better" when |difference| (A - B) exceeds two standard errors, else "not decided"."""
    if not math.isfinite(se) or abs(difference) <= SIGMAS * se:
        return "not decided"
    a_lower = difference < 0
    return f"{a} better" if a_lower == lower_is_better else f"{b} better"


def across_seeds(gaps: list[tuple[float, float]]) -> tuple[float, float]:
    """One pair's gap when both were healed again with other seeds and scored on the same text: ``gaps`` holds each
    seed's (difference, standard error). The gap is the seeds' mean; its error adds the seeds' spread (the standard
    error of their mean) to the text's. The seeds share the windows and documents, so the text's error does not
    average away over them: it enters as the seeds' mean standard error, not divided by their number."""
    if len(gaps) < 2:
        raise UsageError("the spread of seeds needs at least two seeds")
    differences = np.array([g[0] for g in gaps])
    spread = differences.std(ddof=1) / math.sqrt(len(gaps))
    text = float(np.mean([g[1] for g in gaps]))
    return float(differences.mean()), math.hypot(spread, text)


def perplexity_stats(
    rows: list[dict], key: str, resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[list[str], np.ndarray] | None:
    """The models' names and [models, resamples + 1] log-ratios against the first model (the reference):
    ``key`` "ood" (mean over domains of the log-ratio) or "in_domain"; None when no row kept its windows."""
    kept = [r for r in rows if r.get(f"{key}_windows")]
    if not kept or kept[0] is not rows[0]:
        return None
    names = [r["name"] for r in kept]
    if key == "ood":
        domains = list(kept[0]["ood_windows"])
        groups = {d: {r["name"]: r["ood_windows"][d] for r in kept} for d in domains}
    else:
        groups = {"in_domain": {r["name"]: r["in_domain_windows"] for r in kept}}
    logs = log_ppl_resamples(groups, resamples, seed)
    ratios = np.mean([g - g[0] for g in logs.values()], axis=0)  # log-ratio to the reference, averaged over groups
    return names, ratios


def add_perplexity_intervals(result: dict, resamples: int = RESAMPLES, seed: int = SEED) -> None:
    """Each row's out-of-domain and in-domain ratio gets its standard error and 95% interval (in place)."""
    for key in ("ood", "in_domain"):
        got = perplexity_stats(result["rows"], key, resamples, seed)
        if got is None:
            continue
        names, ratios = got
        for row in result["rows"]:
            if row["name"] in names:
                row[f"{key}_ratio_stats"] = summary(ratios[names.index(row["name"])])


def task_correct(row: dict, task: str) -> dict[int, float] | None:
    """{document id: headline-metric score} of one model on one task, None when the row kept no documents."""
    docs = (row.get("tasks") or {}).get(task, {}).get("docs")
    return dict(zip(docs["ids"], docs["correct"])) if docs else None


def paired_accuracy(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """(accuracy A - accuracy B, its standard error, documents) over the documents both scored. The SE is of the
    mean per-document difference (McNemar's: only documents the two disagree on add to it)."""
    common = sorted(set(a) & set(b))
    if len(common) < 2:
        raise UsageError("fewer than two documents scored by both models: compare models of one suite run")
    diff = np.array([a[d] - b[d] for d in common], dtype=np.float64)
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(len(diff))), len(diff)


HALVES = ("select", "report")


def half(result: dict, part: str) -> dict:
    """A suite result cut to the first (``select``) or second (``report``) half of every domain's windows and
    every task's documents: a choice made on one half is reported on the other, so that it does not grade itself.
    The held-out split is the choosing half's alone (its windows all go to ``select``, none to ``report``)."""
    if part not in HALVES:
        raise UsageError(f"unknown half {part!r}; use one of {', '.join(HALVES)}")

    def cut(seq: list) -> list:
        n = len(seq) // 2
        return seq[:n] if part == "select" else seq[n:]

    rows = []
    for row in result["rows"]:
        row = dict(row)
        row["ood_windows"] = {d: {k: cut(v) for k, v in w.items()} for d, w in (row.get("ood_windows") or {}).items()}
        if part == "report":
            row.pop("in_domain_windows", None)
        tasks = {}
        for t, got in (row.get("tasks") or {}).items():
            docs = got.get("docs")
            if docs:
                order = sorted(range(len(docs["ids"])), key=lambda i: docs["ids"][i])
                keep = cut(order)
                got = {**got, "docs": {k: [v[i] for i in keep] for k, v in docs.items()}}
            tasks[t] = got
        row["tasks"] = tasks
        rows.append(row)
    return {**result, "rows": rows}


def row_by_name(rows: list[dict], name: str) -> dict:
    for r in rows:
        if name in (r.get("name"), r["model"]):
            return r
    raise UsageError(f"no model {name!r} in the suite; its models are {', '.join(r['name'] for r in rows)}")


def compare(result: dict, a: str, b: str, metric: str, resamples: int = RESAMPLES, seed: int = SEED) -> dict:
    """Paired comparison of models A and B of one suite result on one metric:
    "ood" / "in_domain" (difference in log-perplexity, lower is better), a task name, or "average" (the tasks'
    mean accuracy, higher is better). Returns {a, b, metric, difference, se, n, verdict}; "verdict" names the
    better model beyond two standard errors, else reads "not decided"."""
    rows = result["rows"]
    ra, rb = row_by_name(rows, a), row_by_name(rows, b)
    out = {"a": ra["name"], "b": rb["name"], "metric": metric}
    if metric in ("ood", "in_domain"):
        got = perplexity_stats(rows, metric, resamples, seed)
        if got is None or ra["name"] not in got[0] or rb["name"] not in got[0]:
            raise UsageError(f"the suite kept no per-window {metric} losses of {a} and {b}; rerun `looplm eval suite`")
        names, ratios = got
        diff = ratios[names.index(ra["name"])] - ratios[names.index(rb["name"])]
        difference, se, n = float(diff[0]), float(diff[1:].std(ddof=1)), None
        lower_is_better = True
    else:
        tasks = [metric] if metric != "average" else list(result.get("tasks") or [])
        parts = []
        for t in tasks:
            ca, cb = task_correct(ra, t), task_correct(rb, t)
            if ca is None or cb is None:
                raise UsageError(
                    f"the suite kept no per-document results of {t} for {a} and {b}; rerun it with --tasks"
                )
            parts.append(paired_accuracy(ca, cb))
        if not parts:
            raise UsageError(f"the suite scored no tasks to compare {metric!r} on; rerun it with --tasks")
        # the tasks' documents are independent: the average's variance is the mean of their variances / tasks
        difference = sum(p[0] for p in parts) / len(parts)
        se = math.sqrt(sum(p[1] ** 2 for p in parts)) / len(parts)
        n = sum(p[2] for p in parts)
        lower_is_better = False
    out.update(
        difference=difference, se=se, n=n, verdict=verdict(difference, se, ra["name"], rb["name"], lower_is_better)
    )
    return out


def default_pairs(result: dict) -> list[tuple[str, str]]:
    """The first non-reference model against every later one."""
    names = [r["name"] for r in result["rows"][1:]]
    return [(names[0], other) for other in names[1:]]


def metrics_of(result: dict) -> list[str]:
    """The metrics a suite result can compare on: ood, in_domain when scored, each task and the average."""
    rows = result["rows"]
    out = ["ood"] + (["in_domain"] if all(r.get("in_domain_windows") for r in rows) else [])
    tasks = list(result.get("tasks") or [])
    if tasks and all((r.get("tasks") or {}).get(t, {}).get("docs") for r in rows for t in tasks):
        out += tasks + (["average"] if len(tasks) > 1 else [])
    return out


def comparisons(result: dict, pairs: list[tuple[str, str]], resamples: int = RESAMPLES, seed: int = SEED) -> list:
    return [compare(result, a, b, m, resamples, seed) for a, b in pairs for m in metrics_of(result)]
