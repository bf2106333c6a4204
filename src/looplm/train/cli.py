"""Training subcommands: `looplm train`, `looplm heal`, `looplm plot`."""

from __future__ import annotations

import json
import os
from pathlib import Path



def register(sub) -> None:
    t = sub.add_parser("train", help="uptrain / early-exit train a (relaxed) recursive model")
    t.add_argument("--model", default=None, help="student: embedded name, looplm/HF dir or .gguf "
                                                 "(convert first with `looplm convert`)")
    t.add_argument("--data", required=True, help="corpus dir from `looplm data build`")
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument("--teacher", default=None, help="frozen teacher for online distillation (the full-size model)")
    t.add_argument("--kd", default="fkl", help="fkl | rkl | jsd | tvd")
    t.add_argument("--kd-weight", type=float, default=0.5, help="w in (1-w) CE + w KD on the final exit")
    t.add_argument("--kd-temperature", type=float, default=1.0)
    t.add_argument("--early-exit", default="none", help="none | weighted | aggressive: a loss on every loop's exit")
    t.add_argument("--exit-coef", type=float, default=0.1, help="c of the aggressive strategy")
    t.add_argument("--self-distill", action="store_true", help="intermediate exits also learn the detached final exit")
    t.add_argument("--self-distill-weight", type=float, default=1.0)
    t.add_argument("--exit-adapter", default=None, help="head-lora:R | affine: add an adapter per intermediate exit "
                                                        "(a LoRA on the LM head, or a tuned-lens affine map); the "
                                                        "final exit is untouched (docs/TRAINING.md)")
    t.add_argument("--freeze-body", action="store_true", help="train only the exit adapter: body, embeddings and head "
                                                              "frozen (the paper's appendix-I ablation); a --teacher "
                                                              "then teaches the intermediate exits")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--budget-minutes", type=float, default=None,
                   help="train for this many minutes of step time (evaluations and saves not counted): the step "
                        "count is fixed after the first steps are timed, and kept on --resume")
    t.add_argument("--batch-size", type=int, default=2, help="sequences per process per micro-step")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--seq-len", type=int, default=None, help="crop the corpus's sequences to this length")
    t.add_argument("--lr", type=float, default=2e-4)
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    t.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of the steps")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--precision", default="auto", help="auto (bf16 autocast where supported) | bf16 | fp32")
    t.add_argument("--grad-checkpointing", action="store_true", help="recompute activations per depth")
    t.add_argument("--train", default="all", help="all, or a comma list of lora, prefix, layers, norms, embed, exit")
    t.add_argument("--eval-every", type=int, default=0, help="held-out perplexity per loop exit every N steps")
    t.add_argument("--eval-seqs", type=int, default=16, help="held-out sequences per evaluation")
    t.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and always at the end)")
    t.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    t.add_argument("--log-every", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data-rows", default=None, choices=["all", "new"],
                   help="new: only training rows no earlier run of --model read (post-training on new tokens, as "
                        "the paper does); default: new with --early-exit, all otherwise")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    h = sub.add_parser("heal", help="heal a converted model: layer-local then end-to-end distillation from the "
                                    "original (docs/TRAINING.md)")
    h.add_argument("model", help="the converted model (looplm directory from `looplm convert`)")
    h.add_argument("--teacher", required=True, help="the original model it was converted from")
    h.add_argument("--data", required=True, help="corpus dir from `looplm data build` (training split is read)")
    h.add_argument("--out", required=True, help="run directory (final/ holds the healed model)")
    budget = h.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-minutes", type=float, help="wall time of the whole run (evaluations not counted)")
    budget.add_argument("--tokens", type=int, help="instead: tokens per shared layer (local) plus end to end")
    h.add_argument("--local-share", type=float, default=0.5, help="share of the budget for layer-local distillation")
    h.add_argument("--local-mode", default="parallel", help="parallel (the original's inputs) | sequential (the "
                                                            "student's own inputs, GPTQ's order)")
    h.add_argument("--cache", default=None, help="teacher cache directory (default OUT/cache; reused if it matches)")
    h.add_argument("--cache-rows", type=int, default=256, help="training rows of the corpus cached (x --seq-len tokens)")
    h.add_argument("--seq-len", type=int, default=512)
    h.add_argument("--local-batch", type=int, default=4, help="rows per tied depth per local step")
    h.add_argument("--local-lr", type=float, default=2e-3)
    h.add_argument("--e2e-batch", type=int, default=2)
    h.add_argument("--e2e-lr", type=float, default=1e-4)
    h.add_argument("--e2e-rows", default="online", choices=["online", "cache"], help="rows of the end-to-end and "
                   "exit stages: online (the whole training split, the original run on each batch: new text every "
                   "step) | cache (the cached rows again, the original read from the cache: a step a fifth shorter, "
                   "but the rows are memorised)")
    h.add_argument("--e2e-average", type=float, default=0.0, help="decay of an exponential moving average of the "
                   "weights the end-to-end stage trains, evaluated beside them; the stage ends on it (0: off)")
    h.add_argument("--hidden-weight", type=float, default=1.0, help="weight of the per-depth hidden-state term")
    h.add_argument("--hidden-loss", default="log1p", help="per-token hidden-state error: log1p (log(1 + x) of the "
                   "relative one: a token far off pulls with a bounded gradient) | relative (squared, relative to the "
                   "original's state)")
    h.add_argument("--exit-weight", type=float, default=0.0, help="weight of each intermediate loop exit's KD term on "
                                                              "the body (0: exits get their own adapter stage)")
    h.add_argument("--exit-target", default="teacher", help="what the --exit-weight term matches: teacher (the "
                   "original's output) | final (the student's own full-depth output, detached: the agreement "
                   "early exits are judged by)")
    h.add_argument("--exit-adapter", default="affine", help="exit stage: an adapter per intermediate loop exit "
                   "trained on the frozen body, affine (tuned lens) | head-lora:R | none")
    h.add_argument("--exit-share", type=float, default=0.1, help="share of what the local stage leaves for the exit stage")
    h.add_argument("--exit-lr", type=float, default=1e-3)
    h.add_argument("--precision", default="auto", help="auto (bf16 autocast where the hardware has bf16 matmuls) | "
                                                      "bf16 | fp32")
    h.add_argument("--base-weights", default="float", help="float | int4 | int8: round the shared weights to that "
                   "format first (GPTQ) and keep them frozen, so that the LoRA, norms and biases learn around the "
                   "rounding the served model will have (`looplm quantize --weights FMT` then rounds nothing new)")
    h.add_argument("--compile", action="store_true", help="torch.compile each layer for the training stages "
                   "(needs a C++ compiler on CPU, triton on CUDA): faster steps after ~40 s of compiling")
    h.add_argument("--eval-rows", type=int, default=16, help="held-out rows scored at each evaluation")
    h.add_argument("--ood-windows", type=int, default=4, help="windows of each out-of-domain domain (text no corpus "
                   "holds: `looplm eval suite`) scored at each evaluation (0: none)")
    h.add_argument("--eval-every-seconds", type=float, default=300.0)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    h.add_argument("--no-progress", action="store_true")
    h.set_defaults(func=cmd_heal)

    pl = sub.add_parser("plot", help="loss and perplexity curves of one or more runs as PNG")
    pl.add_argument("runs", nargs="+")
    pl.add_argument("--out", default=None, help="directory for the PNGs (default: the first run)")
    pl.set_defaults(func=cmd_plot)


def cmd_train(args) -> int:
    from .loop import TrainConfig, train
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__})
    cfg.progress = not args.no_progress
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
    return 0


def cmd_heal(args) -> int:
    from .heal import HealConfig, heal
    cfg = HealConfig(**{k: v for k, v in vars(args).items() if k in HealConfig.__dataclass_fields__})
    cfg.progress = not args.no_progress
    r = heal(cfg)
    conv = r["converted"]["ppl"] if r["converted"] else float("nan")
    print(f"held-out perplexity ({r['healed']['eval_tokens']} tokens): original {r['teacher']['ppl']:.2f}, "
          f"converted {conv:,.2f}, healed {r['healed']['ppl']:,.2f} "
          f"(loop exits: {', '.join(f'{p:,.2f}' for p in r['healed']['ppl_per_loop'])})")
    if "ood_ratio" in r["healed"]:
        print(f"out-of-domain perplexity ({', '.join(r['healed']['ood'])}): {r['healed']['ood_ratio']:.3f}x the "
              f"original's (geometric mean; `looplm eval suite` scores more text)")
    print(f"healed in {r['minutes']:.1f} min; wrote {r['final']} and {Path(r['out']) / 'heal.png'}")
    return 0


def cmd_plot(args) -> int:
    from .plot import plot_runs
    paths = plot_runs([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    for p in paths:
        print(f"wrote {p}")
    return 0




