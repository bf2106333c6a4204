"""Baseline students of the paper that `looplm convert` does not make.

    python -m looplm.train.baselines scratch --model smollm2-135m --layers 15 --out out/m/scratch-15l

writes a vanilla (B = 1) model of the same family and width with ``--layers`` layers and fresh
weights (the reduced-size model "trained from scratch on the same recipe"); the tokenizer and
embedding size are the source model's. Train it with `looplm train` like any other student.
The other baselines are conversion options (`looplm convert --init random`, or the full-size model
itself as `--model`); see docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..cli import UsageError


def scratch_model(vanilla, layers: int, seed: int = 0):
    from ..models import LoopLMConfig, LoopLMForCausalLM
    c = vanilla.config
    if c.num_loops != 1:
        raise UsageError("give the vanilla (full-size) model as --model")
    if not 1 <= layers <= c.num_hidden_layers:
        raise UsageError(f"--layers {layers} must be in 1..{c.num_hidden_layers}")
    d = c.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "id2label", "label2id"):
        d.pop(k, None)
    d.update(num_hidden_layers=layers, depth_attention=list(c.depth_attention[:layers]),
             conversion={**c.conversion, "init": "scratch", "layers": layers})
    torch.manual_seed(seed)
    return LoopLMForCausalLM(LoopLMConfig(**d)).to(next(vanilla.parameters()).dtype)


def main(argv=None) -> int:
    from ..models import load_model, save_model
    p = argparse.ArgumentParser(prog="python -m looplm.train.baselines", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scratch", help="a reduced-depth vanilla model with fresh weights")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--layers", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    vanilla, tok = load_model(args.model)
    model = scratch_model(vanilla, args.layers, args.seed)
    save_model(model, tok, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {args.layers} layers, {n:,} parameters, fresh weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
