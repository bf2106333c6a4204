"""Does a healed model fit the cached rows it trained on better than text it never read? (docs/FINDINGS.md,
"Rank 128 on a Xeon with AMX"). `looplm heal` draws its local stage's rows, and by default its end-to-end
stage's, from its teacher cache; this scores the healed model and the original on sets of the same size: cached
training rows, (with `--e2e-rows online`) rows the end-to-end stage read online, training rows the run never read,
held-out rows. The student's cross-entropy gap to the original on each set tells memorisation (a smaller gap on
the rows read) from generalisation.

    PYTHONPATH=src .venv/bin/python scripts/heal_overfit.py out/heal/runs/b2-r128 --rows 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from looplm.data.corpus import PackedCorpus
from looplm.eval.perplexity import score_windows
from looplm.models import load_model
from looplm.train.heal import cached_rows, streamed_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a `looplm heal` run directory (run.json, final/)")
    p.add_argument("--rows", type=int, default=16, help="rows per set")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    run = json.loads((Path(a.run) / "run.json").read_text())
    cfg, plan = run["config"], run["plan"]
    corpus = PackedCorpus(cfg["data"])
    train = corpus.splits["train"]
    cached = cached_rows(len(train), cfg["cache_rows"], cfg["seed"])
    rng = np.random.default_rng(a.seed)
    sets = {"cached training rows": train[np.sort(rng.choice(cached, size=a.rows, replace=False))]}
    read = cached
    if cfg.get("e2e_rows", "cache") == "online":  # the end-to-end stage's rows, then the exit stage's from half way
        stream, batch = streamed_rows(corpus, cfg["seed"]), cfg["e2e_batch"]
        online = np.concatenate([stream[:plan["e2e_steps"] * batch],
                                 stream[len(stream) // 2:][:plan.get("exit_steps", 0) * batch]])
        sets["training rows read online"] = train[np.sort(rng.choice(online, size=a.rows, replace=False))]
        read = np.union1d(read, online)
    never = rng.choice(np.setdiff1d(np.arange(len(train)), read), size=a.rows, replace=False)
    sets.update({"training rows never read": train[np.sort(never)], "held-out rows": corpus.splits["heldout"][:a.rows]})
    healed, tok = load_model(str(Path(a.run) / "final"))
    original, _ = load_model(cfg["teacher"])
    result = {}
    with torch.no_grad():
        for name, rows in sets.items():
            windows = [[int(t) for t in r] for r in rows]
            s, t = (score_windows(m.eval(), tok, windows)["perplexity"] for m in (healed, original))
            result[name] = {"healed_ppl": round(s, 2), "original_ppl": round(t, 2), "ratio": round(s / t, 3)}
            print(f"{name:34s} healed {s:8.2f}  original {t:8.2f}  ratio {s / t:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
