"""Why data-aware LoRA failed on Gemma 3 with tied norms: one rank, svd vs aware-svd, under three norm
settings (per-depth; tied-avg without norm folding; tied-avg with folding). Prints one JSON line each.

Needs the calibration statistics that scripts/aware_sweep.py caches (run its Gemma command first):

    PYTHONPATH=src python scripts/aware_gemma_norms.py --calib out/aware/calib_gemma3_4096.pt \\
        > docs/aware/gemma3_b3_norms.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from looplm.data import sample_text
from looplm.convert import aware, convert
from looplm.eval.perplexity import perplexity
from looplm.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--calib", required=True, help="statistics saved by aware_sweep.py --calib-cache")
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    vanilla, tok = load_model(args.model)
    calib = aware.Calibration.load(args.calib)
    for norms, fold in [("per-depth", True), ("tied-avg", False), ("tied-avg", True)]:
        for lora_init in ["svd", "aware-svd"]:
            calib.fold_norms = fold
            start = time.time()
            model = convert(vanilla, args.loops, init="average", norms=norms, lora_ranks=args.rank,
                            lora_init=lora_init, calibration=calib)
            ppl = perplexity(model, tok, sample_text(), max_tokens=args.ppl_tokens)["perplexity"]
            print(json.dumps(dict(norms=norms, fold=fold, lora_init=lora_init, ppl=ppl,
                                  s=round(time.time() - start))), flush=True)


if __name__ == "__main__":
    main()
