"""Held-out perplexity per loop exit of saved models, on the rows `looplm heal` scores: the first
ROWS rows of a corpus's held-out split, SEQ_LEN tokens each (the heal.json and heal_report figures).

    PYTHONPATH=src .venv/bin/python scripts/heldout_ppl.py out/heal/corpus-smollm2-135m-512 \
        out/heal/models/b2-r64 out/heal/models/b2-r64-tiednorms
"""

from __future__ import annotations

import argparse

import numpy as np

from looplm.data.corpus import PackedCorpus
from looplm.eval.perplexity import score_windows
from looplm.models import load_model


def heldout_ppl(model, tok, held, rows: int, seq_len: int) -> list[float]:
    """Perplexity at every loop exit on the first ``rows`` held-out rows (the rows `looplm heal` scores)."""
    windows = [np.asarray(held[i, :seq_len], dtype=np.int64).tolist() for i in range(min(rows, len(held)))]
    return [x["perplexity"] for x in score_windows(model.eval(), tok, windows, batch_size=1)["per_loop"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", help="corpus directory from `looplm data build`")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    held = PackedCorpus(args.corpus).splits["heldout"]
    for path in args.models:
        ppl = heldout_ppl(*load_model(path), held, args.rows, args.seq_len)
        print(f"{path}: " + ", ".join(f"loop {i + 1} {p:,.2f}" for i, p in enumerate(ppl)))


if __name__ == "__main__":
    main()
