"""The paper's seven few-shot tasks through lm-evaluation-harness, on our ``looplm`` lm-eval model.

Results are saved as JSON inside the model (or run) directory:

* ``DIR/eval/fewshot.json``: exit after all B loops (per_loop holds every exit 1..B when asked);
* ``DIR/eval/fewshot-exit<i>.json``: a static exit after loop i;
* ``DIR/eval/ppl-<name>.json``: perplexity runs (``looplm eval ppl``).

``looplm report`` reads these files. Runs on the same file with the same settings merge their tasks.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


def _headline(task_result: dict, metric: str) -> tuple[float | None, float | None]:
    for key, val in task_result.items():
        if key.split(",")[0] == metric and "stderr" not in key:
            stderr = task_result.get(f"{metric}_stderr,none")
            return float(val), (float(stderr) if isinstance(stderr, (int, float)) else None)
    return None, None


def model_summary(model) -> dict:
    from ..convert.recursive import count_parameters

    c = model.config
    counts = count_parameters(model)
    conv = dict(c.conversion or {})
    return {
        "n_emb": counts["n_emb"],
        "total_params": counts["total"],
        "num_loops": c.num_loops,
        "num_hidden_layers": c.num_hidden_layers,
        "lora_ranks": dict(c.lora_ranks),
        "init": conv.get("init"),
        "lora_init": conv.get("lora_init"),
        "source": conv.get("source"),
        "exit_adapter": c.exit_adapter,
        "exit_adapter_params": counts["exit_adapter"],
        "conversion": conv,
    }


def run_fewshot(
    model,
    tokenizer,
    tasks: list[str],
    limit: int | None = None,
    exit_loop: int | None = None,
    all_loops: bool = False,
    batch_size: int = 16,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    progress: bool = True,
    exit_rule=None,
    exit_rule_name: str = "",
) -> dict:
    """Evaluate short task names (see looplm.eval.tasks.PAPER7) at one exit, or at every exit.

    ``exit_rule(logits, loop index) -> bool`` (e.g. an exit policy's decision) also scores every task with each
    token taken at the loop the rule exits it after (teacher-forced dynamic exit).

    Returns {"tasks": {name: {metric, value, stderr, n, metrics}}, "average", "exit_loop",
    "per_loop": {loop: {"tasks": {name: value}, "average"}} (all_loops), "samples" (log_samples),
    "exit_rule": {"name", "tasks", "average", "exits_per_loop", "agreement", "mean_exit_loop"} (exit_rule)}."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval

    from .tasks import PAPER7

    B = model.config.num_loops
    final = model.model.check_loops(exit_loop)
    lm, tm = _harness(model, tokenizer, final, batch_size, all_loops, exit_rule)
    names = [PAPER7[t][0] for t in tasks]
    started = time.perf_counter()

    def evaluate(loop: int):
        return _evaluate(lm, tm, names, loop, limit, num_fewshot, log_samples)

    res = evaluate(final)
    task_res, avg = _summarise(res, tasks)
    shots = {PAPER7[t][0]: res.get("n-shot", {}).get(PAPER7[t][0]) for t in tasks}
    result = {
        "tasks": task_res,
        "average": avg,
        "exit_loop": final,
        "num_loops": B,
        "limit": limit,
        "num_fewshot": shots,
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else None,
    }
    if log_samples:
        result["samples"] = {t: [_sample(s) for s in res["samples"][PAPER7[t][0]]] for t in tasks}
    if all_loops:
        result["per_loop"] = _per_loop(evaluate, final, tasks, task_res, avg)
    if exit_rule is not None:
        result["exit_rule"] = _exit_rule_result(lm, evaluate, final, tasks, exit_rule_name)
    result["seconds"] = round(time.perf_counter() - started, 2)
    result["model"] = model_summary(model)
    return result


def _harness(model, tokenizer, final: int, batch_size: int, all_loops: bool, exit_rule):
    """Our lm-eval model (exiting after loop ``final``) and a task manager that knows the project's tasks alone."""
    from lm_eval.tasks import TaskManager

    from .lm_eval_adapter import LoopLMEval
    from .tasks import include_path

    lm = LoopLMEval(
        pretrained=model,
        tokenizer=tokenizer,
        exit_loop=final,
        batch_size=batch_size,
        all_loops=all_loops,
        exit_rule=exit_rule,
    )
    return lm, TaskManager(include_path=str(include_path()), include_defaults=False)


def _evaluate(lm, tm, names: list[str], loop: int, limit, num_fewshot, log_samples: bool) -> dict:
    """lm-eval's raw results for the tasks ``names``, every token taken at the exit after ``loop``."""
    import lm_eval

    lm.exit_loop = loop
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=names,
        task_manager=tm,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=log_samples,
        bootstrap_iters=1000,
        verbosity="ERROR",
    )


def _summarise(res: dict, tasks: list[str]) -> tuple[dict, float]:
    """Each short task name's headline figures from lm-eval's results, and their average (nan without any)."""
    from .tasks import BESIDE, PAPER7

    out = {}
    for short in tasks:
        tname, metric = PAPER7[short]
        r = res["results"][tname]
        value, stderr = _headline(r, metric)
        beside, beside_stderr = _headline(r, BESIDE)
        out[short] = {
            "metric": metric,
            "value": value,
            "stderr": stderr,
            BESIDE: beside,
            f"{BESIDE}_stderr": beside_stderr,
            "n": int(res.get("n-samples", {}).get(tname, {}).get("effective", 0)),
            "metrics": {k.split(",")[0]: v for k, v in r.items() if isinstance(v, (int, float)) and "stderr" not in k},
        }
    vals = [v["value"] for v in out.values() if v["value"] is not None]
    return out, (sum(vals) / len(vals) if vals else math.nan)


def _values(task_res: dict) -> dict:
    """{task: headline value}: what a per-loop or exit-rule row keeps of each task."""
    return {t: v["value"] for t, v in task_res.items()}


def _per_loop(evaluate, final: int, tasks: list[str], task_res: dict, avg: float) -> dict:
    """{loop: {"tasks", "average"}} for every exit 1..final, the final one's from the run already made."""
    per_loop = {str(final): {"tasks": _values(task_res), "average": avg}}
    for loop in range(1, final):
        tr, a = _summarise(evaluate(loop), tasks)
        per_loop[str(loop)] = {"tasks": _values(tr), "average": a}
    return dict(sorted(per_loop.items(), key=lambda kv: int(kv[0])))


def _exit_rule_result(lm, evaluate, final: int, tasks: list[str], name: str) -> dict:
    """The tasks scored with each token taken at the loop the exit rule leaves it after, and where it left."""
    lm.use_exit_rule = True
    tr, a = _summarise(evaluate(final), tasks)  # served from the memo: every token was scored at its exit
    st = lm.exit_stats
    n = max(1, st["tokens"])
    return {
        "name": name,
        "tasks": _values(tr),
        "average": a,
        "exits_per_loop": st["exits_per_loop"],
        "scored_tokens": st["tokens"],
        "agreement": st["agree"] / n,
        "mean_exit_loop": sum((i + 1) * e for i, e in enumerate(st["exits_per_loop"])) / n,
    }


def _sample(s: dict) -> dict:
    """The per-item record kept for parity checks: doc id, target, loglikelihoods and per-item metrics."""
    resps = s.get("filtered_resps") or s.get("resps")
    out = {
        "doc_id": s["doc_id"],
        "target": str(s.get("target")),
        "loglikelihoods": [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in resps],
    }
    for k in ("acc", "acc_norm", "acc_bytes", "perplexity"):
        if k in s:
            out[k] = s[k] if not isinstance(s[k], tuple) else list(s[k])
    return out


def results_path(directory: str | Path, kind: str, exit_loop: int | None = None, final: bool = True) -> Path:
    name = kind if final or exit_loop is None else f"{kind}-exit{exit_loop}"
    return Path(directory) / "eval" / f"{name}.json"


def save_results(result: dict, path: str | Path) -> Path:
    """Write (merging tasks with an earlier run of the same settings) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = result
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = None
        if (
            old
            and old.get("limit") == result.get("limit")
            and old.get("exit_loop") == result.get("exit_loop")
            and "tasks" in old
            and "tasks" in result
        ):
            merged = {**old, **{k: v for k, v in result.items() if k not in ("tasks", "per_loop")}}
            merged["tasks"] = {**old["tasks"], **result["tasks"]}
            vals = [v["value"] for v in merged["tasks"].values() if v.get("value") is not None]
            merged["average"] = sum(vals) / len(vals) if vals else math.nan
            if "per_loop" in result:
                pl = dict(old.get("per_loop") or {})
                for loop, row in result["per_loop"].items():
                    tasks = {**(pl.get(loop, {}).get("tasks") or {}), **row["tasks"]}
                    vals = [v for v in tasks.values() if v is not None]
                    pl[loop] = {"tasks": tasks, "average": sum(vals) / len(vals) if vals else math.nan}
                merged["per_loop"] = pl
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(merged, indent=2, default=str))
    os.replace(tmp, path)
    return path
