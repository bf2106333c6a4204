"""Baseline students of the paper that `looplm convert` does not make (`looplm baseline`).

``scratch_model``: a vanilla (B = 1) model of the same family and width with ``layers`` layers and fresh weights
(the reduced-size model "trained from scratch on the same recipe"); the tokenizer and embedding size are the
source model's. Train it with `looplm train` like any other student.

``stepwise_model``, the reduced-size model: the "pretrained Stepwise layers without looping" baseline of the paper's
individual-contributions table (appendix E): the K = L / B layers Stepwise selects (or ``--layers`` of them,
the reduced-size model of a plan with unique layers, at its N-emb), the first and the last kept, with their
norms, run once each (B = 1), and the pretrained embeddings, final norm and head.
The other baselines are conversion options (`looplm convert --init random`, or the full-size model
itself); see docs/guides/heal.md.
"""

from __future__ import annotations

import torch

from ..errors import UsageError


def _shallower(vanilla, layers: list[int], init: str):
    """A fresh vanilla model of the source's family and width whose depth j has the attention kind of
    the source's depth layers[j]."""
    from ..models import LoopLMConfig, LoopLMForCausalLM

    c = vanilla.config
    if c.num_loops != 1:
        raise UsageError("give the vanilla (full-size) model, not a looped one")
    d = c.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "id2label", "label2id"):
        d.pop(k, None)
    d.update(
        num_hidden_layers=len(layers),
        depth_attention=[c.depth_attention[i] for i in layers],
        depth_rope=[c.depth_rope[i] for i in layers],
        conversion={**c.conversion, "init": init, "layers": layers},
    )
    return LoopLMForCausalLM(LoopLMConfig(**d)).to(next(vanilla.parameters()).dtype)


def scratch_model(vanilla, layers: int, seed: int = 0):
    if not 1 <= layers <= vanilla.config.num_hidden_layers:
        raise UsageError(f"--layers {layers} must be in 1..{vanilla.config.num_hidden_layers}")
    torch.manual_seed(seed)
    return _shallower(vanilla, list(range(layers)), "scratch")


@torch.no_grad()
def stepwise_model(vanilla, loops: int | None = None, layers: int | None = None):
    """``layers`` (or L / ``loops``) Stepwise-selected layers of ``vanilla`` without looping, the first and the
    last among them; every other weight pretrained."""
    from ..convert import stepwise_layers

    L = vanilla.config.num_hidden_layers
    if (loops is None) == (layers is None):
        raise UsageError("give --loops B (L / B layers) or --layers N, not both")
    if layers is None:
        if loops < 1 or L % loops:
            raise UsageError(f"--loops {loops} does not divide the model's {L} layers; give --layers N instead")
        layers = L // loops
    if not 1 <= layers <= L:
        raise UsageError(f"--layers {layers} must be in 1..{L}")
    chosen = stepwise_layers(L, layers)
    model = _shallower(vanilla, chosen, "stepwise-noloop")
    src = vanilla.state_dict()
    for name, p in model.state_dict().items():
        parts = name.split(".")
        if name.startswith("model.layers."):
            parts[2] = str(chosen[int(parts[2])])
        p.copy_(src[".".join(parts)])
    return model.eval()
