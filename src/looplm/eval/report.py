"""`looplm report`: the paper's results table and Pareto plot from saved eval results.

Each RUN is a model or run directory holding ``eval/*.json`` (written by ``looplm eval fewshot`` and
``looplm eval ppl``; see looplm.eval.fewshot). Per run the table shows N-emb, loops B, looping init,
LoRA rank and init, every perplexity found, the seven task accuracies and their average (static exit
after all loops). Early-exit runs (``--all-loops`` or ``fewshot-exit<i>.json`` files) get a second table
of accuracy per exit loop. The plot is average accuracy against N-emb (the paper's Figure 8c).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .tasks import BESIDE, PAPER7

TASK_HEAD = {
    "lambada": "LD",
    "hellaswag": "HS",
    "piqa": "PQ",
    "winogrande": "WG",
    "arc_easy": "ARC-e",
    "arc_challenge": "ARC-c",
    "openbookqa": "OB",
}


def _read(p: Path) -> dict | None:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_run(run: str | Path) -> dict:
    d = Path(run)
    ev = d / "eval" if (d / "eval").is_dir() else d
    if not ev.is_dir():
        raise ValueError(f"{d} is not a directory; give model or run directories that hold eval/*.json")
    files = sorted(ev.glob("*.json"))
    if not files:
        raise ValueError(f"{d} has no eval/*.json results; run `looplm eval fewshot {d}` first")
    run_info = {"name": d.name, "path": str(d), "fewshot": None, "exits": {}, "ppl": {}, "model": {}}
    for f in files:
        data = _read(f)
        if not data:
            continue
        if data.get("model"):
            run_info["model"] = {**run_info["model"], **data["model"]}
        if f.stem == "fewshot":
            run_info["fewshot"] = data
            for loop, row in (data.get("per_loop") or {}).items():
                run_info["exits"][int(loop)] = row
        elif f.stem.startswith("fewshot-exit"):
            loop = int(f.stem.removeprefix("fewshot-exit"))
            run_info["exits"].setdefault(
                loop, {"tasks": {t: v["value"] for t, v in data["tasks"].items()}, "average": data["average"]}
            )
            if run_info["fewshot"] is None and data.get("exit_loop") == data.get("num_loops"):
                run_info["fewshot"] = data
        elif f.stem.startswith("ppl-") and "-exit" not in f.stem:
            run_info["ppl"][f.stem.removeprefix("ppl-")] = data.get("perplexity")
    if not run_info["model"] and (d / "config.json").exists():
        cfg = _read(d / "config.json") or {}
        conv = cfg.get("conversion") or {}
        run_info["model"] = {
            "num_loops": cfg.get("num_loops"),
            "lora_ranks": cfg.get("lora_ranks"),
            "init": conv.get("init"),
            "lora_init": conv.get("lora_init"),
        }
    return run_info


def _rank(ranks: dict | None) -> str:
    vals = sorted({int(v) for v in (ranks or {}).values()})
    if not vals or vals == [0]:
        return "-"
    return str(vals[0]) if len(vals) == 1 else "/".join(map(str, vals))


def _pct(v, stderr=None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{100 * v:.1f}" + ("" if stderr is None else f" ± {100 * stderr:.1f}")


def task_value(task: dict, metric: str) -> tuple[float | None, float | None]:
    """(value, stderr) of a saved task result under ``metric``: results saved before acc_bytes became the
    headline hold it among their ``metrics`` (without a standard error)."""
    if task.get("metric") == metric:
        return task.get("value"), task.get("stderr")
    if task.get(metric) is not None:
        return task[metric], task.get(f"{metric}_stderr")
    return (task.get("metrics") or {}).get(metric), None


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _scores(fs: dict | None, tasks: list[str]) -> tuple[dict, float | None, float | None]:
    """Per task (headline value, stderr), the headline average, and the average with acc_norm where a
    task has it (the harness's usual metric, kept beside the paper's)."""
    if not fs:
        return {}, None, None
    got = {t: task_value(fs["tasks"][t], PAPER7[t][1]) for t in tasks if t in fs["tasks"]}
    beside = [task_value(fs["tasks"][t], BESIDE)[0] for t in got]
    beside = [b if b is not None else got[t][0] for b, t in zip(beside, got)]
    return got, _mean(v for v, _ in got.values()), _mean(beside)


def _ppl(v) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 1e4 else f"{v:.2e}"


def _nemb(m: dict) -> str:
    n = m.get("n_emb")
    return "-" if n is None else f"{n / 1e6:.1f}M"


def build_report(runs: list[str], out: str | Path, title: str | None = None) -> dict:
    infos = [load_run(r) for r in runs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ppl_names = sorted({k for i in infos for k in i["ppl"]})
    tasks = [t for t in PAPER7 if any(i["fewshot"] and t in i["fewshot"]["tasks"] for i in infos)]
    lines = [f"# {title or 'Evaluation report'}", ""]
    lines += _fewshot_note(infos, tasks)
    head = (
        ["Model", "N-emb", "B", "Init", "LoRA rank", "LoRA init"]
        + [f"PPL {p}" for p in ppl_names]
        + [TASK_HEAD[t] for t in tasks]
        + ["Avg", f"Avg ({BESIDE})"]
    )
    lines += _table_head(head)
    rows = []
    for i in infos:
        cells, row = _run_row(i, ppl_names, tasks)
        lines.append("| " + " | ".join(cells) + " |")
        rows.append(row)
    early = [i for i in infos if len(i["exits"]) > 1]
    if early:
        lines += ["", "## Accuracy per exit loop (static exit)", ""]
        lines += _exit_table(early, tasks)
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    png = _pareto(rows, out / "pareto.png")
    return {"markdown": str(md), "pareto": str(png) if png else None, "rows": rows}


def _table_head(head: list[str]) -> list[str]:
    """A markdown table's header row and separator."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def _fewshot_note(infos: list[dict], tasks: list[str]) -> list[str]:
    """The lines saying how the few-shot figures were measured; none when no run has any."""
    limits = sorted({str(i["fewshot"].get("limit")) for i in infos if i["fewshot"]})
    if not limits:
        return []
    return [
        f"Few-shot: lm-eval standard prompts and shots (0), limit per task: {', '.join(limits)} "
        f"(None = full). Metrics (the paper's): "
        + ", ".join(f"{TASK_HEAD[t]} {PAPER7[t][1]}" for t in tasks)
        + f", ± one standard error; the last column averages {BESIDE} where a task has it.",
        "",
    ]


def _run_row(info: dict, ppl_names: list[str], tasks: list[str]) -> tuple[list[str], dict]:
    """One run's cells of the main table, and its row of the returned result (the plot's point)."""
    m, fs = info["model"], info["fewshot"]
    cells = [
        info["name"],
        _nemb(m),
        str(m.get("num_loops") or "-"),
        str(m.get("init") or "-"),
        _rank(m.get("lora_ranks")),
        str(m.get("lora_init") or "-") if _rank(m.get("lora_ranks")) != "-" else "-",
    ]
    cells += [_ppl(info["ppl"].get(p)) for p in ppl_names]
    scores, average, average_beside = _scores(fs, tasks)
    cells += [_pct(*scores.get(t, (None, None))) for t in tasks] + [_pct(average), _pct(average_beside)]
    row = {
        "name": info["name"],
        "n_emb": m.get("n_emb"),
        "average": average,
        f"average_{BESIDE}": average_beside,
        "tasks": {t: v for t, (v, _) in scores.items()},
        "stderr": {t: s for t, (_, s) in scores.items()},
        "ppl": info["ppl"],
        "per_loop": {str(k): v for k, v in sorted(info["exits"].items())},
    }
    return cells, row


def _exit_table(early: list[dict], tasks: list[str]) -> list[str]:
    """Accuracy at each exit loop of the runs scored at several exits."""
    lines = _table_head(["Model", "Exit loop"] + [TASK_HEAD[t] for t in tasks] + ["Avg"])
    for i in early:
        for loop, row in sorted(i["exits"].items()):
            cells = [i["name"], str(loop)] + [_pct(row["tasks"].get(t)) for t in tasks] + [_pct(row["average"])]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _pareto(rows: list[dict], path: Path) -> Path | None:
    pts = [
        (r["n_emb"] / 1e6, 100 * r["average"], r["name"])
        for r in rows
        if r["n_emb"] is not None and r["average"] is not None and not math.isnan(r["average"])
    ]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], zorder=3)
    for x, y, name in pts:
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    # Pareto frontier: no other model is both smaller and at least as accurate.
    front, best = [], -math.inf
    for x, y, _ in sorted(pts, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="gray", zorder=2, label="Pareto frontier")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("non-embedding parameters (M)")
    ax.set_ylabel("average few-shot accuracy (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
