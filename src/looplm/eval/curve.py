"""`looplm eval curve`: how quality grows with healing tokens, from saved suite results, with a fitted power law.

Each point is a suite row of a healed model at its healing tokens (``heal_tokens``: the end-to-end stages' tokens
plus one shared layer's layer-local tokens, the unit of `looplm heal --train-tokens`). The rows may come from several
results files when these were scored alike (same reference, domains, windows and text), so a new budget is one more
suite run, not a rescoring of the old ones.

The fit: the out-of-domain gap to the original, L = log(perplexity / original's), as a power of the tokens,
L(T) = a * T**-b, a straight line in log L against log T. It is weighted by each point's standard error, and the
errors are widened by the points' scatter about the line where that is larger (four points leave two degrees of
freedom, so the interval uses Student's t). The form has no floor: if the gap levels off, every budget read off it
for a target ratio is too short, so those budgets are lower bounds, and a target below the measured range is an
extrapolation the interval prices only for the fit's own uncertainty.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..util import write_json_atomic
from .suite import heal_tokens

FORM = "log(ppl / original's) = a * tokens^-b"
TARGETS = (2.0, 1.6, 1.3)  # the default-hour goal and the long-range goals at rank 64 and 128
ALIKE = ("reference", "domains", "windows", "seq_len", "data_heldout_sha256", "tasks", "limit")
DRAWS = 20000


def load_points(paths: list[str]) -> tuple[dict, list[dict], dict]:
    """The reference row, the healed rows (each with its ``heal_tokens``), sorted by tokens, and the settings the
    files share; a file scored otherwise, or a row whose tokens are unknown, is refused."""
    reference, points, alike = None, [], None
    for path in paths:
        result = json.loads(Path(path).read_text())
        these = {k: result.get(k) for k in ALIKE}
        if alike is not None and these != alike:
            differ = [k for k in ALIKE if these[k] != alike[k]]
            raise UsageError(f"{path} was scored with other {', '.join(differ)} than {paths[0]}; score alike")
        alike = these
        reference = reference or result["rows"][0]
        for row in result["rows"][1:]:
            tokens = row.get("heal_tokens") or heal_tokens(row["model"])
            if tokens is None:
                raise UsageError(f"{path}: row {row['name']} is no `looplm heal` run's final/ (its tokens are unknown)")
            points.append({**row, "heal_tokens": tokens})
    if len(points) < 3:
        raise UsageError(f"a curve needs at least 3 healed rows ({len(points)} given); heal at more budgets")
    return reference, sorted(points, key=lambda r: r["heal_tokens"]), alike


def fit_power_law(tokens: np.ndarray, gap: np.ndarray, gap_se: np.ndarray) -> dict:
    """Weighted least squares of log gap = c0 + c1 log tokens. Returns a, b (= -c1), the coefficients' covariance
    (widened by the reduced chi-square where above 1), the degrees of freedom and the reduced chi-square."""
    if np.any(gap <= 0):
        raise UsageError("a point is no worse than the original out of domain: the gap has no logarithm to fit")
    x, y = np.log(tokens), np.log(gap)
    w = (gap / gap_se) ** 2  # 1 / variance of log gap
    design = np.stack([np.ones_like(x), x], axis=1)
    normal = design.T @ (design * w[:, None])
    coef = np.linalg.solve(normal, design.T @ (w * y))
    dof = len(x) - 2
    chi2 = float(np.sum(w * (y - design @ coef) ** 2) / dof) if dof else math.nan
    cov = np.linalg.inv(normal) * max(1.0, chi2 if math.isfinite(chi2) else 1.0)
    return {"a": float(math.exp(coef[0])), "b": float(-coef[1]), "coef": coef, "cov": cov, "dof": dof, "chi2": chi2}


def _draws(fit: dict, seed: int) -> np.ndarray:
    """Coefficient draws from the fit's multivariate t (``DRAWS`` x 2): the intervals are their percentiles."""
    rng = np.random.default_rng(seed)
    z = rng.multivariate_normal(np.zeros(2), fit["cov"], size=DRAWS)
    dof = max(fit["dof"], 1)
    return fit["coef"] + z * np.sqrt(dof / rng.chisquare(dof, size=DRAWS))[:, None]


def tokens_for(fit: dict, ratio: float, draws: np.ndarray) -> dict:
    """The tokens at which the fitted gap reaches ``ratio`` x the original, with a 95% interval from the draws (inf
    where a draw's gap does not fall)."""

    def solve(c0, c1):
        with np.errstate(all="ignore"):  # a flat draw never reaches the target: inf
            return np.where(c1 < 0, np.exp((math.log(math.log(ratio)) - c0) / c1), np.inf)

    point = float(solve(fit["coef"][0], fit["coef"][1]))
    low, high = np.percentile(solve(draws[:, 0], draws[:, 1]), [2.5, 97.5])
    return {"ratio": ratio, "tokens": point, "low": float(low), "high": float(high)}


def band(draws: np.ndarray, tokens: np.ndarray) -> dict:
    """The fit's 95% band of the out-of-domain ratio at ``tokens``, from the coefficient draws."""
    with np.errstate(over="ignore"):  # a steep draw's ratio far from its points: inf, beyond the band
        ratios = np.exp(np.exp(draws[:, :1] + draws[:, 1:] * np.log(tokens)[None, :]))
    low, high = np.percentile(ratios, [2.5, 97.5], axis=0)
    return {"tokens": tokens.tolist(), "low": low.tolist(), "high": high.tolist()}


def _point(row: dict) -> dict:
    st = row.get("ood_ratio_stats") or {}
    lambada = (row.get("tasks") or {}).get("lambada") or {}
    return {
        "name": row["name"],
        "heal_tokens": row["heal_tokens"],
        "ood_ratio": row["ood_ratio"],
        "ood_low": st.get("ratio_low"),
        "ood_high": st.get("ratio_high"),
        "ood_log_se": st.get("log_se"),
        "in_domain_ratio": row.get("in_domain_ratio"),
        "lambada": lambada.get("value"),
        "lambada_se": lambada.get("stderr"),
        "budget": row.get("budget"),
    }


def build_curve(paths: list[str], targets: tuple[float, ...] = TARGETS, seed: int = 0) -> dict:
    """The points, the fit and the tokens it implies for each target ratio."""
    reference, rows, alike = load_points(paths)
    points = [_point(r) for r in rows]
    if any(p["ood_log_se"] is None for p in points):
        raise UsageError("a row has no out-of-domain standard error: score it with `looplm eval suite` (windows kept)")
    tokens = np.array([p["heal_tokens"] for p in points], dtype=float)
    gap = np.log([p["ood_ratio"] for p in points])
    fit = fit_power_law(tokens, gap, np.array([p["ood_log_se"] for p in points]))
    draws = _draws(fit, seed)
    b_low, b_high = np.percentile(-draws[:, 1], [2.5, 97.5])
    lambada = ((reference.get("tasks") or {}).get("lambada") or {}).get("value")
    return {
        "results": paths,
        "settings": alike,
        "reference": {"name": reference["name"], "lambada": lambada},
        "points": points,
        "fit": {
            "form": FORM,
            "a": fit["a"],
            "b": fit["b"],
            "b_low": float(b_low),
            "b_high": float(b_high),
            "dof": fit["dof"],
            "reduced_chi2": fit["chi2"],
        },
        "targets": [tokens_for(fit, r, draws) for r in targets],
        "band": band(draws, np.geomspace(tokens.min() / 2, tokens.max() * 8, 60)),
        "seed": seed,
    }


def _tokens(n: float) -> str:
    return "never" if not math.isfinite(n) else f"{n / 1e6:,.1f}M" if n >= 1e6 else f"{n / 1e3:,.0f}k"


def markdown(curve: dict) -> str:
    f = curve["fit"]
    lines = [
        "| healing tokens | off the corpus (x original) | held-out split | LAMBADA |",
        "|---:|---:|---:|---:|",
    ]
    for p in curve["points"]:
        held = f"{p['in_domain_ratio']:.2f}x" if p["in_domain_ratio"] else "-"
        lam = f"{100 * p['lambada']:.1f} ± {100 * p['lambada_se']:.1f}" if p["lambada"] is not None else "-"
        interval = f" [{p['ood_low']:.2f}, {p['ood_high']:.2f}]" if p["ood_low"] else ""
        lines.append(f"| {p['heal_tokens']:,} | {p['ood_ratio']:.2f}x{interval} | {held} | {lam} |")
    lines += [
        "",
        f"Fit: {f['form']}, b = {f['b']:.3f} [{f['b_low']:.3f}, {f['b_high']:.3f}] (95%, {f['dof']} degrees of "
        f"freedom, reduced chi-square {f['reduced_chi2']:.2f}).",
        "",
        "| target (x original) | tokens the fit implies | 95% interval |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {t['ratio']}x | {_tokens(t['tokens'])} | {_tokens(t['low'])} to {_tokens(t['high'])} |"
        for t in curve["targets"]
    ]
    return "\n".join(lines) + "\n"


def plot(curve: dict, path: Path) -> Path:
    """Out-of-domain ratio against tokens (log-log) with the fit and its band; LAMBADA against tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    pts, f = curve["points"], curve["fit"]
    x = np.array([p["heal_tokens"] for p in pts], dtype=float)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    y = np.array([p["ood_ratio"] for p in pts])
    err = [y - np.array([p["ood_low"] for p in pts]), np.array([p["ood_high"] for p in pts]) - y]
    ax.errorbar(x, y, yerr=err, ls="none", marker="o", capsize=3, label="healed (95% interval)")
    grid = np.array(curve["band"]["tokens"])
    ax.plot(grid, np.exp(f["a"] * grid ** -f["b"]), ls="--", color="C1", label=f"fit: {f['form']}, b={f['b']:.2f}")
    ax.fill_between(grid, curve["band"]["low"], curve["band"]["high"], color="C1", alpha=0.15, label="95% band")
    for t in curve["targets"]:
        ax.axhline(t["ratio"], color="grey", lw=0.6, ls=":")
        ax.annotate(f"{t['ratio']}x", (grid[0], t["ratio"]), fontsize=7, color="grey", va="bottom")
    ax.set(xscale="log", yscale="log", xlabel="healing tokens", ylabel="out-of-domain perplexity (x original)")
    ax.set_ylim(min(t["ratio"] for t in curve["targets"]) * 0.9, max(y) * 1.6)
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend(fontsize=8)
    lam = [p for p in pts if p["lambada"] is not None]
    if lam:
        ax2.errorbar(
            [p["heal_tokens"] for p in lam],
            [100 * p["lambada"] for p in lam],
            yerr=[100 * p["lambada_se"] for p in lam],
            ls="none",
            marker="o",
            capsize=3,
        )
        if curve["reference"]["lambada"] is not None:
            ax2.axhline(100 * curve["reference"]["lambada"], color="grey", ls="--", label="original")
            ax2.legend(fontsize=8)
        ax2.set(xscale="log", xlabel="healing tokens", ylabel="LAMBADA accuracy (%)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save(curve: dict, out: str | Path) -> tuple[Path, Path]:
    """OUT.json (the points, the fit, the targets) and OUT.png."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out.with_suffix(".json"), curve)
    return out.with_suffix(".json"), plot(curve, out.with_suffix(".png"))
