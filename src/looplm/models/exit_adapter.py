"""Exit adapters: a small trainable module per intermediate loop, applied only at the exit after that loop.

The exit after loop i < B normally reads the same final norm and LM head as the final output, which were
trained for the last loop's states. An exit adapter gives each intermediate exit its own correction while
the body, the head and the final exit stay untouched (so the model's normal output is unchanged):

- ``head-lora`` (the paper's appendix-I ablation): a LoRA on the LM head per exit,
  logits_i = head(norm(h)) + B_i A_i norm(h); A Gaussian, B zero, so it starts as the plain exit.
- ``affine`` (a "tuned lens", Belrose et al. 2023): h' = h + W_i h + b_i, then the usual norm and head;
  W_i and b_i start at zero.

Adapter i belongs to the exit after loop i (0-based), i = 0..B-2; the final loop has none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError

KINDS = ("head-lora", "affine")


def check_exit_adapter(spec: dict | None, hidden_size: int | None = None) -> dict | None:
    """The canonical form of an exit-adapter spec ({"kind": "head-lora", "rank": r} or {"kind": "affine"}),
    or None; bad input raises UsageError."""
    if spec is None:
        return None
    kind = spec.get("kind")
    if kind not in KINDS:
        raise UsageError(f"unknown exit adapter kind {kind!r}; use one of {', '.join(KINDS)}")
    if kind == "affine":
        return {"kind": "affine"}
    rank = spec.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise UsageError(f"a head-lora exit adapter needs a whole-number rank >= 1, got {rank!r}")
    if hidden_size is not None and rank > hidden_size:
        raise UsageError(
            f"head-lora rank {rank} exceeds the hidden size {hidden_size}, above which it adds "
            f"nothing; use at most {hidden_size}"
        )
    return {"kind": "head-lora", "rank": rank}


def parse_exit_adapter(text: str) -> dict:
    """'head-lora:128' or 'affine' (the command-line form) -> a spec."""
    kind, sep, rank = text.partition(":")
    if kind == "head-lora":
        if not rank.strip().lstrip("-").isdigit():
            raise UsageError(f"--exit-adapter {text!r}: give the rank as a whole number, e.g. head-lora:128")
        return check_exit_adapter({"kind": kind, "rank": int(rank)})
    if sep:
        raise UsageError(f"--exit-adapter {text!r}: only head-lora takes a rank (head-lora:R); use affine")
    return check_exit_adapter({"kind": kind})


class ExitAdapter(nn.Module):
    """The adapters of the B - 1 intermediate exits, stacked: [B - 1, ...] per parameter."""

    def __init__(self, spec: dict, num_loops: int, hidden_size: int, vocab_size: int):
        super().__init__()
        spec = check_exit_adapter(spec, hidden_size)
        self.kind, n = spec["kind"], num_loops - 1
        if self.kind == "head-lora":
            self.rank = spec["rank"]
            self.head_A = nn.Parameter(torch.empty(n, self.rank, hidden_size))
            self.head_B = nn.Parameter(torch.empty(n, vocab_size, self.rank))
        else:
            self.weight = nn.Parameter(torch.empty(n, hidden_size, hidden_size))
            self.bias = nn.Parameter(torch.empty(n, hidden_size))
        self.reset_parameters()

    @property
    def num_exits(self) -> int:
        return (self.head_A if self.kind == "head-lora" else self.weight).shape[0]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity start: every exit equals the plain exit until the adapter is trained."""
        if self.kind == "head-lora":
            nn.init.normal_(self.head_A, std=self.head_A.shape[-1] ** -0.5)
            nn.init.zeros_(self.head_B)
        else:
            nn.init.zeros_(self.weight)
            nn.init.zeros_(self.bias)

    def _per_loop(self, out: torch.Tensor, src: torch.Tensor, loop, fn) -> torch.Tensor:
        """out + fn(src, i) on the rows whose loop i has an adapter. ``loop`` is an int (every row) or a
        LongTensor of shape out.shape[:-1] (a batch mixing loops: one call per loop present, like the
        grouped LoRA of the layers), never a Python loop over rows."""
        if isinstance(loop, int):
            return out + fn(src, loop) if loop < self.num_exits else out
        flat_out, flat_src, loops = out.reshape(-1, out.shape[-1]), src.reshape(-1, src.shape[-1]), loop.reshape(-1)
        for i in range(self.num_exits):
            idx = (loops == i).nonzero(as_tuple=True)[0]
            if idx.numel():
                flat_out = flat_out.index_add(0, idx, fn(flat_src.index_select(0, idx), i).to(flat_out.dtype))
        return flat_out.reshape(out.shape)

    def adapt_hidden(self, h: torch.Tensor, loop) -> torch.Tensor:
        """affine: h + W_i h + b_i, before the final norm; head-lora: h unchanged."""
        if self.kind != "affine":
            return h
        return self._per_loop(h, h, loop, lambda x, i: F.linear(x, self.weight[i], self.bias[i]))

    def adapt_logits(self, logits: torch.Tensor, z: torch.Tensor, loop) -> torch.Tensor:
        """head-lora: logits + B_i A_i z, z = norm(h) being the head's input; affine: logits unchanged."""
        if self.kind != "head-lora":
            return logits
        return self._per_loop(logits, z, loop, lambda x, i: F.linear(F.linear(x, self.head_A[i]), self.head_B[i]))


def add_exit_adapters(model, kind: str, rank: int | None = None) -> ExitAdapter:
    """Give ``model`` (a LoopLMForCausalLM) a fresh exit adapter of ``kind`` (head-lora with ``rank``, or
    affine), identity-initialised, on the model's device and dtype, recorded in its config so that it is
    saved and loaded with the model. Returns the adapter. A model that already has one must have the same
    spec (its trained adapter is kept and returned)."""
    c = model.config
    spec = check_exit_adapter({"kind": kind, "rank": rank} if kind == "head-lora" else {"kind": kind}, c.hidden_size)
    if c.num_loops < 2:
        raise UsageError("an exit adapter serves the exits after intermediate loops, and this model has one loop")
    if model.exit_adapter is not None:
        if c.exit_adapter != spec:
            raise UsageError(
                f"the model already has a {describe_spec(c.exit_adapter)} exit adapter, not "
                f"{describe_spec(spec)}: leave out --exit-adapter to keep training it, or start from a model "
                f"healed with `--exit-adapter none`"
            )
        return model.exit_adapter
    p = next(model.parameters())
    model.exit_adapter = ExitAdapter(spec, c.num_loops, c.hidden_size, c.vocab_size).to(p.device, p.dtype)
    c.exit_adapter = spec
    return model.exit_adapter


def freeze_all_but_exit_adapter(model) -> list[nn.Parameter]:
    """Freeze the body, embeddings, final norm and head; return the exit adapter's parameters, the only
    trainable ones (the paper's appendix-I setting)."""
    if model.exit_adapter is None:
        raise UsageError(
            "freezing the body leaves nothing to train: the model has no exit adapter "
            "(add one: --exit-adapter head-lora:R or affine)"
        )
    model.requires_grad_(False)
    model.exit_adapter.requires_grad_(True)
    return list(model.exit_adapter.parameters())


def describe_spec(spec: dict | None) -> str:
    """'head-lora:128', 'affine' or 'none': the command-line form of a spec."""
    if not spec:
        return "none"
    return f"head-lora:{spec['rank']}" if spec["kind"] == "head-lora" else spec["kind"]
