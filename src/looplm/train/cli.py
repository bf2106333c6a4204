"""Training subcommands: `looplm data build`, `looplm train`, `looplm plot`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path



def register(sub) -> None:
    from .sources import DEFAULT_SOURCES, SOURCES
    p = sub.add_parser("data", help="training corpora")
    dsub = p.add_subparsers(dest="data_command", required=True)
    b = dsub.add_parser("build", help="fetch sources, split held-out text, tokenise and pack into a corpus dir",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="sources:\n" + "\n".join(f"  {k:12s} {v}" for k, v in SOURCES.items()))
    b.add_argument("--out", required=True, help="corpus directory (re-running it skips finished work)")
    b.add_argument("--model", default="smollm2-135m", help="model whose tokenizer to use")
    b.add_argument("--sources", default=",".join(DEFAULT_SOURCES),
                   help="comma list of source names and/or directories of .txt files (one source per file)")
    b.add_argument("--seq-len", type=int, default=1024, help="tokens per packed sequence")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction of each source (by block hash)")
    b.add_argument("--block-chars", type=int, default=16000, help="size of the blocks the split assigns")
    b.add_argument("--refresh", action="store_true", help="fetch sources again even if cached")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_data_build)

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
    g = t.add_mutually_exclusive_group()
    g.add_argument("--max-steps", type=int, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
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
    t.add_argument("--train", default="all", help="all, or a comma list of lora, layers, norms, embed")
    t.add_argument("--eval-every", type=int, default=0, help="held-out perplexity per loop exit every N steps")
    t.add_argument("--eval-seqs", type=int, default=16, help="held-out sequences per evaluation")
    t.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (and always at the end)")
    t.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    t.add_argument("--log-every", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plot", help="loss and perplexity curves of one or more runs as PNG")
    pl.add_argument("runs", nargs="+")
    pl.add_argument("--out", default=None, help="directory for the PNGs (default: the first run)")
    pl.set_defaults(func=cmd_plot)


def cmd_data_build(args) -> int:
    from .corpus import build
    meta = build(args.out, model=args.model, sources=args.sources, seq_len=args.seq_len, heldout=args.heldout,
                 block_chars=args.block_chars, refresh=args.refresh, progress=not args.no_progress)
    s = meta["splits"]
    print(f"wrote {args.out}: {s['train']['seqs']} train / {s['heldout']['seqs']} held-out sequences of "
          f"{meta['seq_len']} tokens ({len(meta['sources'])} sources, tokenizer {meta['tokenizer']})")
    return 0


def cmd_train(args) -> int:
    from .loop import TrainConfig, train
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__})
    cfg.progress = not args.no_progress
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
    return 0


def cmd_plot(args) -> int:
    from .plot import plot_runs
    paths = plot_runs([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    for p in paths:
        print(f"wrote {p}")
    return 0




