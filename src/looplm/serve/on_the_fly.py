"""A looped model converted at load time. Conversion alone leaves a model whose output is poor (healing is
what makes it close to the original), so serving one needs the caller's explicit consent."""

from __future__ import annotations

from ..errors import UsageError


def check_unhealed(model: str, loops: int, allow: bool) -> None:
    """A usage error, before anything loads, when ``model`` would be converted to ``loops`` loops at load
    without ``allow`` (the ``--allow-unhealed`` flag)."""
    if loops and loops > 1 and not allow:
        raise UsageError(
            f"{model} would be converted to {loops} loops now and served unhealed, and an unhealed "
            f"looped model's output is poor; convert and heal it first (`looplm convert {model} --loops "
            f"{loops} --out DIR`, then `looplm heal DIR`) and serve the healed model (DIR-healed/final), "
            f"or pass --allow-unhealed to serve it anyway"
        )


def convert_unhealed(vanilla, name: str, loops: int, init: str, lora_rank: str, allow: bool, seed: int = 0):
    """``vanilla`` converted to ``loops`` loops with per-depth norms and SVD-initialised LoRA of ``lora_rank``,
    after ``check_unhealed``."""
    check_unhealed(name, loops, allow)
    from ..convert import convert, parse_lora_ranks

    return convert(
        vanilla, loops=loops, init=init, lora_ranks=parse_lora_ranks(None, lora_rank), norms="per-depth", seed=seed
    )
