"""Training subcommands: `looplm train`, `looplm heal`, `looplm plot`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..cli_args import HelpFormatter, add_flags, add_model, from_args
from .heal.config import COMPILE_MINUTES, DEFAULT_HEAL_MINUTES, HealConfig

# the flags each command's help lists first, in this order (the others follow in their dataclass's order: the
# command's own settings, then those every run has: train/settings.py RunSettings)
TRAIN_FLAGS_FIRST = (
    "data",
    "out",
    "teacher",
    "kd",
    "kd_weight",
    "early_exit",
    "max_steps",
    "train_tokens",
    "budget_minutes",
)
# the teacher's own text in the recipe's corpus: more than an hour of healing reads (about 1,200 rows of 512
# tokens with as many real ones), so no row is read twice
TEACHER_TOKENS = 300_000
HEAL_FLAGS_FIRST = ("teacher", "data", "out", "budget_minutes", "train_tokens", "base_weights", "compile")


def register(sub) -> None:
    from .loop import TrainConfig

    t = sub.add_parser(
        "train", help="uptrain / early-exit train a (relaxed) recursive model", formatter_class=HelpFormatter
    )
    add_model(
        t,
        "the student: embedded name, looplm/HF directory or .gguf (convert first with `looplm convert`; "
        "default with --resume: the run's)",
        required=False,
    )
    add_flags(t, TrainConfig, first=TRAIN_FLAGS_FIRST)
    t.set_defaults(func=cmd_train)

    h = sub.add_parser(
        "heal",
        help="heal a converted model: layer-local then end-to-end distillation from the original",
        formatter_class=HelpFormatter,
    )
    add_model(h, "the converted model (looplm directory from `looplm convert`)")
    add_flags(h, HealConfig, first=HEAL_FLAGS_FIRST)
    h.set_defaults(func=cmd_heal)

    pl = sub.add_parser(
        "plot", help="loss and perplexity curves of one or more runs as PNG", formatter_class=HelpFormatter
    )
    pl.add_argument("runs", nargs="+", help="run directories of `looplm train` or `looplm heal`")
    pl.add_argument("--out", default=None, help="directory for the PNGs (default: the first run)")
    pl.set_defaults(func=cmd_plot)


def cmd_train(args) -> int:
    from .loop import TrainConfig, train

    result = train(from_args(TrainConfig, args))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result))
    return 0


def cmd_heal(args) -> int:
    from .heal import heal

    _heal_defaults(args)
    r = heal(from_args(HealConfig, args))
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the main process reports the run
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
        args.data = _recipe_corpus(args.teacher, args.seq_len, args.progress)
        chosen.append(f"data {args.data}")
    if args.out is None:
        args.out = str(Path("out") / f"{Path(args.model).name}-healed")
        chosen.append(f"out {args.out}")
    if args.budget_minutes is None and args.train_tokens is None:
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


def _recipe_corpus(teacher: str, seq_len: int, progress: bool) -> str:
    """The recipe's corpus, made once per teacher and reused: text the teacher writes itself beside as many tokens
    of the real sources. Healed on it, a model stays closer to the original on text neither holds than healed on
    the real sources alone (docs/RESULTS.md, "Healed quality off the corpus")."""
    from ..data.corpus import build, teacher_mix_sources
    from ..errors import UsageError
    from ..recipes.teacher_text import GenerateConfig, generate_corpus

    name = Path(teacher).name
    corpus, generated = Path("out") / f"corpus-{name}-mix-{seq_len}", Path("out") / f"gen-{name}"
    if (corpus / "meta.json").exists():
        return str(corpus)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(
            f"the recipe's corpus {corpus} is not made yet and {os.environ['WORLD_SIZE']} processes would each make "
            f"it: run `looplm heal` on one process first, or give --data"
        )
    print(
        f"looplm heal: the teacher writes {TEACHER_TOKENS:,} tokens of its own text into {generated} (once per "
        "teacher, resumable; docs/guides/heal.md gives its time)",
        file=sys.stderr,
    )
    m = generate_corpus(GenerateConfig(model=teacher, out=str(generated), tokens=TEACHER_TOKENS, progress=progress))
    print(
        f"looplm heal: {m['tokens']:,} tokens of the teacher's text in {m['seconds'] / 60:.0f} min "
        f"({m['tokens_per_second']} tokens/s, {m['weights']}); building the corpus {corpus} (a few minutes, once)",
        file=sys.stderr,
    )
    build(corpus, model=teacher, sources=teacher_mix_sources(generated, seq_len), seq_len=seq_len, progress=progress)
    return str(corpus)


def cmd_plot(args) -> int:
    from .plot import plot_runs

    paths = plot_runs([Path(r) for r in args.runs], Path(args.out) if args.out else None)
    for p in paths:
        print(f"wrote {p}")
    return 0
