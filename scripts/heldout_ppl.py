"""Held-out perplexity per loop exit of saved models, on the rows `looplm heal` scores: the first
ROWS rows of a corpus's held-out split, SEQ_LEN tokens each (the heal.json and heal_report figures).

    PYTHONPATH=src .venv/bin/python scripts/heldout_ppl.py out/heal/corpus-smollm2-135m-512 \
        out/heal/models/b2-r64 out/heal/models/b2-r64-tiednorms
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from looplm.models import load_model
from looplm.data.corpus import PackedCorpus


@torch.no_grad()
def heldout_ppl(model, held, rows: int, seq_len: int) -> list[float]:
    model.eval()
    nll, count = torch.zeros(model.config.num_loops, dtype=torch.float64), 0
    for i in range(min(rows, len(held))):
        ids = torch.from_numpy(np.asarray(held[i:i + 1, :seq_len], dtype=np.int64))
        _, states, _ = model.model(ids, output_loop_states=True)
        for j, h in enumerate(states):
            nll[j] += F.cross_entropy(model.exit_logits(h[0, :-1], loop=j).float(), ids[0, 1:], reduction="sum").double()
        count += ids.shape[1] - 1
    return [math.exp(min(float(x) / count, 50.0)) for x in nll]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", help="corpus directory from `looplm data build`")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    held = PackedCorpus(args.corpus).splits["heldout"]
    for path in args.models:
        ppl = heldout_ppl(load_model(path)[0], held, args.rows, args.seq_len)
        print(f"{path}: " + ", ".join(f"loop {i + 1} {p:,.2f}" for i, p in enumerate(ppl)))


if __name__ == "__main__":
    main()
