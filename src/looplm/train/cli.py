"""Training subcommands: `looplm train`, `looplm heal`, `looplm plot`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..cli_args import HelpFormatter, add_deprecated, add_model, advanced, renamed_choices

DEFAULT_HEAL_MINUTES = 60.0  # the budget the healing recipe is measured at
COMPILE_MINUTES = 15.0  # from this budget on, compiling (about a minute) pays back in faster steps


PRECISIONS = ["auto", "bf16", "fp32"]


def register(sub) -> None:
    t = sub.add_parser(
        "train", help="uptrain / early-exit train a (relaxed) recursive model", formatter_class=HelpFormatter
    )
    add_model(
        t,
        "the student: embedded name, looplm/HF directory or .gguf (convert first with `looplm convert`; "
        "default with --resume: the run's)",
        required=False,
    )
    t.add_argument("--data", required=True, help="corpus dir from `looplm data build`")
    t.add_argument("--out", required=True, help="run directory")
    t.add_argument(
        "--teacher",
        default=None,
        help="frozen teacher for online distillation, the full-size model (default: none, cross-entropy only)",
    )
    t.add_argument(
        "--kd",
        default="fkl",
        choices=["fkl", "rkl", "jsd", "tvd"],
        help="distillation loss: forward KL, reverse KL, Jensen-Shannon or total variation",
    )
    t.add_argument("--kd-weight", type=float, default=0.5, help="w in (1-w) CE + w KD on the final exit")
    t.add_argument(
        "--early-exit",
        default="none",
        choices=["none", "weighted", "aggressive"],
        help="a loss on every loop's exit: none, weighted (alpha_i = i / sum j) or aggressive (the final "
        "exit 1, earlier ones --exit-coef)",
    )
    g = t.add_mutually_exclusive_group()
    g.add_argument(
        "--max-steps", type=int, default=None, help="optimizer steps (one budget is needed: steps, tokens or minutes)"
    )
    g.add_argument(
        "--train-tokens",
        dest="max_tokens",
        type=int,
        default=None,
        metavar="N",
        help="instead: training tokens to read",
    )
    g.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="instead: minutes of step time (evaluations and saves not counted): the step count is fixed "
        "after the first steps are timed, and kept on --resume",
    )
    add_deprecated(g, "--max-tokens", "--train-tokens", "max_tokens", type=int, metavar="N")
    t.add_argument("--batch-size", type=int, default=2, help="sequences per process per micro-step")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    t.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (AdamW, cosine schedule)")
    t.add_argument(
        "--eval-every", type=int, default=0, help="held-out perplexity per loop exit every N steps (0: at the end only)"
    )
    t.add_argument(
        "--eval-rows",
        dest="eval_seqs",
        type=int,
        default=16,
        metavar="N",
        help="held-out rows scored at each evaluation",
    )
    t.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and always at the end)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = advanced(t)
    a.add_argument("--kd-temperature", type=float, default=1.0, help="softmax temperature of the distillation loss")
    a.add_argument("--exit-coef", type=float, default=0.1, help="c of the aggressive strategy")
    a.add_argument("--self-distill", action="store_true", help="intermediate exits also learn the detached final exit")
    a.add_argument("--self-distill-weight", type=float, default=1.0, help="weight of that self-distillation term")
    a.add_argument(
        "--exit-adapter",
        default=None,
        metavar="{head-lora:R,affine}",
        help="add an adapter per intermediate exit: a LoRA of rank R on the LM head, or a tuned-lens "
        "affine map; the final exit is untouched (default: none)",
    )
    a.add_argument(
        "--freeze-body",
        action="store_true",
        help="train only the exit adapter: body, embeddings and "
        "head frozen (the paper's appendix-I ablation); a --teacher then teaches the intermediate exits",
    )
    a.add_argument(
        "--seq-len", type=int, default=None, help="crop the corpus's sequences to this length (default: the corpus's)"
    )
    a.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    a.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: 5%% of the steps)")
    a.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    a.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    a.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="auto: bf16 autocast where the hardware multiplies bf16 natively, else fp32",
    )
    a.add_argument("--grad-checkpointing", action="store_true", help="recompute activations per depth")
    a.add_argument("--train", default="all", help="all, or a comma list of lora, prefix, layers, norms, embed, exit")
    a.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    a.add_argument("--log-every", type=int, default=1, help="a metrics record every N steps")
    a.add_argument("--seed", type=int, default=0, help="seed of the data order and of new parameters")
    a.add_argument(
        "--data-rows",
        default=None,
        choices=["all", "new"],
        help="new: only training rows no earlier run of the model read (post-training on new tokens, as "
        "the paper does); default: new with --early-exit, all otherwise",
    )
    add_deprecated(t, "--eval-seqs", "--eval-rows", "eval_seqs", type=int, metavar="N")
    t.set_defaults(func=cmd_train)

    h = sub.add_parser(
        "heal",
        help="heal a converted model: layer-local then end-to-end distillation from the original",
        formatter_class=HelpFormatter,
    )
    add_model(h, "the converted model (looplm directory from `looplm convert`)")
    h.add_argument(
        "--teacher",
        default=None,
        help="the original model it was converted from (default: the one its conversion recorded)",
    )
    h.add_argument(
        "--data",
        default=None,
        help="corpus dir from `looplm data build` (training split is read; default: "
        "out/corpus-<teacher>-<seq-len>, built from the default sources if missing)",
    )
    h.add_argument(
        "--out", default=None, help="run directory, final/ holds the healed model (default: out/<model>-healed)"
    )
    budget = h.add_mutually_exclusive_group()
    budget.add_argument(
        "--budget-minutes",
        type=float,
        help="wall time of the whole run, evaluations not counted "
        f"(default: {DEFAULT_HEAL_MINUTES:g} unless --train-tokens)",
    )
    budget.add_argument(
        "--train-tokens",
        dest="tokens",
        type=int,
        metavar="N",
        help="instead: training tokens per shared layer (local) plus end to end",
    )
    add_deprecated(budget, "--tokens", "--train-tokens", "tokens", type=int, metavar="N")
    h.add_argument(
        "--base-weights",
        default="fp32",
        choices=["fp32", "int8", "int4"],
        type=renamed_choices("--base-weights", {"float": "fp32"}),
        help="int8, int4: round the shared weights to this format first (GPTQ) and keep them frozen, so "
        "that the LoRA, norms and biases learn around the rounding the served model will have "
        "(`looplm quantize --weights FMT` then rounds nothing new)",
    )
    h.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each layer for the training stages (a C++ compiler on CPU, triton on CUDA): "
        "faster steps after about a minute of compiling (default: on for time budgets of "
        f"{COMPILE_MINUTES:g} minutes or more, where a compiler is found)",
    )
    h.add_argument("--eval-rows", type=int, default=16, help="held-out rows scored at each evaluation")
    h.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    h.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    a = advanced(h)
    a.add_argument("--seq-len", type=int, default=512, help="tokens per training row")
    a.add_argument("--local-share", type=float, default=0.5, help="share of the budget for layer-local distillation")
    a.add_argument(
        "--local-mode",
        default="parallel",
        choices=["parallel", "sequential"],
        help="inputs of the local stage: the original's (parallel) or the student's own (sequential, GPTQ's order)",
    )
    a.add_argument("--cache", default=None, help="teacher cache directory (default: OUT/cache; reused if it matches)")
    a.add_argument(
        "--cache-rows", type=int, default=256, help="training rows of the corpus cached (x --seq-len tokens)"
    )
    a.add_argument("--local-batch", type=int, default=4, help="rows per tied depth per local step")
    a.add_argument("--local-lr", type=float, default=2e-3, help="learning rate of the local stage")
    a.add_argument("--e2e-batch", type=int, default=2, help="rows per end-to-end step")
    a.add_argument("--e2e-lr", type=float, default=1e-4, help="learning rate of the end-to-end stage")
    a.add_argument(
        "--e2e-rows",
        default="online",
        choices=["online", "cache"],
        help="rows of the end-to-end and "
        "exit stages: online (the whole training split, the original run on each batch: new text every "
        "step) | cache (the cached rows again, the original read from the cache: a shorter step, "
        "but the rows are memorised)",
    )
    a.add_argument(
        "--e2e-average",
        type=float,
        default=0.0,
        help="decay of an exponential moving average of the "
        "weights the end-to-end stage trains, evaluated beside them; the stage ends on it (0: off)",
    )
    a.add_argument("--hidden-weight", type=float, default=1.0, help="weight of the per-depth hidden-state term")
    a.add_argument(
        "--hidden-loss",
        default="log1p",
        choices=["log1p", "relative"],
        help="per-token hidden-state error: log1p (log(1 + x) of the relative one: a token far off pulls "
        "with a bounded gradient) | relative (squared, relative to the original's state)",
    )
    a.add_argument(
        "--exit-weight",
        type=float,
        default=0.0,
        help="weight of each intermediate loop exit's KD term on the body (0: exits get their own adapter stage)",
    )
    a.add_argument(
        "--exit-target",
        default="teacher",
        choices=["teacher", "final"],
        help="what the --exit-weight term matches: teacher (the original's output) | final (the student's "
        "own full-depth output, detached: the agreement early exits are judged by)",
    )
    a.add_argument(
        "--exit-adapter",
        default="affine",
        metavar="{affine,head-lora:R,none}",
        help="exit stage: an adapter per intermediate loop exit trained on the frozen body: affine (tuned "
        "lens), a LoRA of rank R on the LM head, or none",
    )
    a.add_argument(
        "--exit-share", type=float, default=0.1, help="share of what the local stage leaves for the exit stage"
    )
    a.add_argument("--exit-lr", type=float, default=1e-3, help="learning rate of the exit stage")
    a.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="auto: bf16 autocast where the hardware multiplies bf16 natively, else fp32",
    )
    a.add_argument(
        "--ood-windows",
        type=int,
        default=4,
        help="windows of each out-of-domain domain (text no corpus "
        "holds: `looplm eval suite`) scored at each evaluation (0: none)",
    )
    a.add_argument("--eval-every-seconds", type=float, default=300.0, help="seconds of training between evaluations")
    a.add_argument("--seed", type=int, default=0, help="seed of the cached rows, the data order and new parameters")
    h.set_defaults(func=cmd_heal)

    pl = sub.add_parser(
        "plot", help="loss and perplexity curves of one or more runs as PNG", formatter_class=HelpFormatter
    )
    pl.add_argument("runs", nargs="+", help="run directories of `looplm train` or `looplm heal`")
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

    _heal_defaults(args)
    if args.base_weights == "fp32":
        args.base_weights = "float"  # HealConfig's name, kept so that earlier runs resume
    cfg = HealConfig(**{k: v for k, v in vars(args).items() if k in HealConfig.__dataclass_fields__})
    cfg.progress = not args.no_progress
    r = heal(cfg)
    conv = r["converted"]["ppl"] if r["converted"] else float("nan")
    print(
        f"held-out perplexity ({r['healed']['eval_tokens']} tokens): original {r['teacher']['ppl']:.2f}, "
        f"converted {conv:,.2f}, healed {r['healed']['ppl']:,.2f} "
        f"(loop exits: {', '.join(f'{p:,.2f}' for p in r['healed']['ppl_per_loop'])})"
    )
    if "ood_ratio" in r["healed"]:
        print(
            f"out-of-domain perplexity ({', '.join(r['healed']['ood'])}): {r['healed']['ood_ratio']:.3f}x the "
            f"original's (geometric mean; `looplm eval suite` scores more text)"
        )
    print(f"healed in {r['minutes']:.1f} min; wrote {r['final']} and {Path(r['out']) / 'heal.png'}")
    return 0


def _heal_defaults(args) -> None:
    """Fill what the command line left out with the recipe's choices, build the default corpus if it is
    missing, and say what was chosen."""
    from ..errors import UsageError
    from ..models.checkpoint import read_config

    chosen = []
    if not (Path(args.model) / "config.json").exists():
        raise UsageError(f"{args.model} is not a converted model directory; make one with `looplm convert` first")
    if args.teacher is None:
        source = read_config(args.model).get("conversion", {}).get("source")
        if not source:
            raise UsageError(f"{args.model} records no model it was converted from; name it with --teacher")
        args.teacher = source
        chosen.append(f"teacher {source} (the model it was converted from)")
    if args.data is None:
        args.data = str(Path("out") / f"corpus-{Path(args.teacher).name}-{args.seq_len}")
        chosen.append(f"data {args.data}")
        if not (Path(args.data) / "meta.json").exists():
            from ..data.corpus import build

            print(f"looplm heal: building the default corpus in {args.data} (a few minutes, once)", file=sys.stderr)
            build(args.data, model=args.teacher, seq_len=args.seq_len, progress=not args.no_progress)
    if args.out is None:
        args.out = str(Path("out") / f"{Path(args.model).name}-healed")
        chosen.append(f"out {args.out}")
    if args.budget_minutes is None and args.tokens is None:
        args.budget_minutes = DEFAULT_HEAL_MINUTES
        chosen.append(f"{args.budget_minutes:g} minutes")
    if args.compile is None:
        import torch

        from ..util import cpu_compiler

        compiler = torch.cuda.is_available() or cpu_compiler() is not None
        args.compile = bool(args.budget_minutes and args.budget_minutes >= COMPILE_MINUTES and compiler)
        chosen.append("compiled" if args.compile else "not compiled")
    if chosen:
        print(f"looplm heal: {', '.join(chosen)}", file=sys.stderr)


def cmd_plot(args) -> int:
    from .plot import plot_runs

    paths = plot_runs([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    for p in paths:
        print(f"wrote {p}")
    return 0
