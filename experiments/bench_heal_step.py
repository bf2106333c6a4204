"""One end-to-end healing step in fp32 against bf16 autocast, run in turn in one process (ratios that a
shared machine's load swings skew less): forward through every depth with the per-depth states, the LM
head, a loss over both, backward, AdamW on the shared layers. Decides `--precision auto` on a new CPU.

    PYTHONPATH=src OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_heal_step.py \
        --model out/heal/models/b2-r64 --seq-len 512 --batch 2 --rounds 2

Variants (``--variants``): ``fp32``, ``bf16``, and ``fp32-lora``: fp32 with the shared weights frozen (only the
LoRAs, norms and biases learn), what the backward pass saves when no shared weight needs its gradient.
Prints the forward, backward and optimizer seconds of each step (the first of each round is a warm-up).
"""

from __future__ import annotations

import argparse
import time

import torch

from looplm.models import load_model
from looplm.models.layers import LoopLinear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a converted looplm model directory")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="fp32,bf16", help="fp32, bf16, fp32-lora, bf16-lora (-lora: shared weights frozen)")
    args = ap.parse_args()
    model, _ = load_model(args.model)
    model.train().requires_grad_(False)
    model.model.layers.requires_grad_(True)
    shared = [m.weight for m in model.model.layers.modules() if isinstance(m, LoopLinear)]
    trainable, shared_ids = [p for p in model.parameters() if p.requires_grad], {id(p) for p in shared}
    opts = {False: torch.optim.AdamW(trainable, lr=1e-6),  # keyed by "shared weights frozen"
            True: torch.optim.AdamW([p for p in trainable if id(p) not in shared_ids], lr=1e-6)}
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    print(f"threads {torch.get_num_threads()}, bf16 matmuls: {torch.cpu._is_avx512_bf16_supported()}")
    for r in range(args.rounds):
        for variant in args.variants.split(","):
            precision, frozen = variant.removesuffix("-lora"), variant.endswith("-lora")
            if precision not in ("fp32", "bf16"):
                raise SystemExit(f"unknown variant {variant!r}; use fp32, bf16, fp32-lora or bf16-lora")
            for p in shared:
                p.requires_grad_(not frozen)
            opt = opts[frozen]
            for s in range(args.steps):
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    _, states, _ = model.model(ids, output_depth_states=True)
                    logits = model.exit_logits(states[-1])
                    loss = logits.float().logsumexp(-1).mean() + sum(h.float().pow(2).mean() for h in states) * 1e-3
                t1 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                print(f"round {r} {variant} step {s}: forward {t1 - t0:.2f} s, backward {t2 - t1:.2f} s, "
                      f"optimizer {t3 - t2:.2f} s, total {t3 - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
