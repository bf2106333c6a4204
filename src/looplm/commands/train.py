"""`looplm train`, `looplm heal` (their settings: TrainConfig and HealConfig) and `looplm plot`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..settings import setting
from ..train.heal.config import HealConfig
from ..train.loop import TrainConfig
from . import command
from .args import write_settings

# the flags each command's help lists first, in this order (the others follow in their dataclass's order: the
# command's own settings, then those every run has: train/settings.py RunSettings)
TRAIN_FIRST = ("data", "out", "teacher", "kd", "kd_weight", "early_exit", "max_steps", "train_tokens", "budget_minutes")
HEAL_FIRST = ("teacher", "data", "out", "budget_minutes", "train_tokens", "base_weights", "compile")


@command("train", help="Uptrain or early-exit train a (relaxed) recursive model.", first=TRAIN_FIRST)
def cmd_train(s: TrainConfig) -> int:
    from ..train.loop import train

    result = train(s)
    if int(os.environ.get("RANK", "0")) == 0:  # the main process reports the run
        write_settings(s.out, "looplm train", s)
        print(json.dumps(result))
    return 0


@command(
    "heal",
    help="Heal a converted model: layer-local, then end-to-end distillation from the original.",
    first=HEAL_FIRST,
)
def cmd_heal(s: HealConfig) -> int:
    from ..recipes.heal import fill_recipe_defaults
    from ..train.heal import heal

    chosen = fill_recipe_defaults(s)
    if chosen:
        print(f"looplm heal: {', '.join(chosen)}", file=sys.stderr)
    r = heal(s)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the main process reports the run
    write_settings(r["out"], "looplm heal", s)
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


@dataclass
class Plot:
    """Loss and perplexity curves of one or more runs as PNG."""

    runs: list[str] = setting([], "run directories of `looplm train` or `looplm heal`", positional=True, nargs="+")
    out: str | None = setting(None, "directory for the PNGs (default: the first run)")


@command("plot")
def cmd_plot(s: Plot) -> int:
    from ..train.plot import plot_runs

    paths = plot_runs([Path(r) for r in s.runs], Path(s.out) if s.out else None)
    for p in paths:
        print(f"wrote {p}")
    return 0
