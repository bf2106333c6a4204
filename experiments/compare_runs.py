"""Held-out loss of uptraining runs side by side, and when the second first reaches the first's final loss.

Usage: python scripts/compare_runs.py OUT.png OUT.json RUN[=label] RUN[=label] ...
Reads each RUN/metrics.jsonl (written by `looplm train`); the first run is the baseline.
"""
import json, sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt

out_png, out_json, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {}
for spec in specs:
    path, _, label = spec.partition("=")
    label = label or path.rstrip("/").split("/")[-1]
    ev, tr = [], []
    for line in open(f"{path}/metrics.jsonl"):
        m = json.loads(line)
        if m.get("eval"):  # the final exit: the highest loop index logged
            last = max(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("eval_loss_"))
            ev.append((m["tokens"], m[f"eval_loss_{last}"], m[f"ppl_{last}"]))
        elif "loss" in m:
            tr.append((m["tokens"], m["loss"], m.get("tok_per_s")))
    runs[label] = {"run": path, "eval": ev, "train": tr}

summary = {}
labels = list(runs)
if len(labels) >= 2:
    base, other = runs[labels[0]], runs[labels[1]]
    target = base["eval"][-1][1]
    reach = next((t for t, l, _ in other["eval"] if l <= target), None)
    summary = {"baseline": labels[0], "baseline_final_tokens": base["eval"][-1][0],
               "baseline_final_eval_loss": target, "baseline_final_ppl": base["eval"][-1][2],
               "other": labels[1], "other_first_reaches_at_tokens": reach,
               "other_final_eval_loss": other["eval"][-1][1], "other_final_ppl": other["eval"][-1][2]}
json.dump({"runs": runs, "summary": summary}, open(out_json, "w"), indent=1)
print(json.dumps(summary, indent=1))

fig, ax = plt.subplots(1, 2, figsize=(11, 4))
for label, r in runs.items():
    t = [e[0] for e in r["eval"]]
    ax[0].plot(t, [e[1] for e in r["eval"]], "o-", label=label)
    ax[1].plot([x[0] for x in r["train"]], [x[1] for x in r["train"]], ".-", label=label)
if summary:
    ax[0].axhline(summary["baseline_final_eval_loss"], color="gray", ls=":", lw=1,
                  label=f"{labels[0]} final")
ax[0].set_xlabel("training tokens"); ax[0].set_ylabel("held-out loss (final exit, nats)")
ax[0].set_title("held-out loss (8 x 256 held-out tokens)")
ax[1].set_xlabel("training tokens"); ax[1].set_ylabel("train loss (0.5 CE + 0.5 FKL)")
ax[1].set_title("training loss")
for a in ax: a.legend(); a.grid(alpha=.3)
fig.suptitle("SmolLM2-135M B=2 rank 64: uptraining after plain vs data-aware conversion")
fig.tight_layout(); fig.savefig(out_png, dpi=110)
