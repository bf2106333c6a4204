"""Where an end-to-end step's hidden-state term spikes: per-depth, per-token relative error of a healed model
against the original on the rows ``--e2e-rows online`` read at given steps (``streamed_rows``), with the worst token.

    PYTHONPATH=src .venv/bin/python scripts/heal_hidden_outliers.py "out/heal/runs/b2-r128@online/final" \
        --data out/heal/corpus-smollm2-135m-512 --steps 145,17
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from looplm.data.corpus import PackedCorpus
from looplm.models import load_model
from looplm.train.heal import streamed_rows, token_errors
from looplm.train.teacher_cache import teacher_states


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a healed looplm directory")
    p.add_argument("--teacher", default="smollm2-135m")
    p.add_argument("--data", required=True, help="the corpus the run read")
    p.add_argument("--steps", default="145", help="end-to-end steps whose rows to score, comma separated")
    p.add_argument("--e2e-batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=512)
    a = p.parse_args()
    torch.set_grad_enabled(False)
    corpus = PackedCorpus(a.data)
    stream = streamed_rows(corpus, a.seed)
    student, tok = load_model(a.model)
    teacher, _ = load_model(a.teacher)
    for step in map(int, a.steps.split(",")):
        rows = stream[np.arange(step * a.e2e_batch, (step + 1) * a.e2e_batch)]
        ids = torch.from_numpy(np.asarray(corpus.splits["train"][rows][:, :a.seq_len], dtype=np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            boundaries = teacher_states(teacher, ids)
            _, depths, _ = student.model(ids, output_depth_states=True)
        print(f"step {step}")
        for d, h in enumerate(depths):
            y = boundaries[d + 1].float()
            per_token = token_errors(h, y)
            r, t = divmod(int(per_token.argmax()), per_token.shape[1])
            print(f"  depth {d:2d}  mean {float(per_token.mean()):.3f}  worst: row {r} position {t} "
                  f"{tok.decode([int(ids[r, t])])!r} {float(per_token[r, t]):.1f}")


if __name__ == "__main__":
    main()
