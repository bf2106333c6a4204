"""A compiled engine step (``Engine(compile=True)``, ``--compile``): torch.compile regions around attention.

At batch 1 with int4 weights a token cost 34.6 ms, of which 12.9 ms were the weight matmuls: the rest was
about 40 small operators per layer (norms, rotary, casts, residuals) and the Python between them
(docs/BENCHMARKS.md, "Against llama.cpp"). Here each shared layer's work before its attention core (norm,
q/k/v projections with per-depth LoRA, q/k norms, rotary) and after it (output projection, residuals, MLP)
runs as one compiled region each: inductor fuses the elementwise work into a few C++ kernels and one call
replaces the Python between them. The attention core (cache writes and reads, SDPA) stays the engine's
own eager code, so the cache layout, the in-place reads and the masks are unchanged.

Regional, not whole-model: every layer runs the same compiled code (its parameters are graph inputs, not
constants), so compiling costs one layer's graphs, not L of them. Graphs are specialised on a step of one
token (batch-1 decode) and dynamic in the token count otherwise, and on the quantized/float kind of the
weights; ``schedulers.warm_up`` compiles them ahead of serving. Only single-depth steps take the compiled path: a step
mixing depths (depth-wise batching with exits) groups its LoRA by depth with data-dependent indexing,
which would break the graph, so it runs eagerly as before.

Weights: no MKL-packed copies (MKL's packed tensor cannot be traced; models/packed.py steps aside under
compilation), so a compiled float32 engine multiplies with inductor's own kernels; int8/int4 weights use the
same PyTorch ops as the eager engine (models/quantized.py).
"""

from __future__ import annotations

import shutil

import torch

from ..errors import UsageError

# One compiled region serves every layer of every model in the process, with one graph per weight kind,
# step shape and depth specialisation: benchmarks that serve fp32, int8, int4 and a looped model in one
# process need more entries than dynamo's default of 8, beyond which it silently runs the region eagerly.
RECOMPILE_LIMIT = 64


def check_compile_available(device) -> None:
    """A one-line UsageError unless torch.compile's inductor backend can build kernels for ``device``."""
    kind = torch.device(device).type
    if kind == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            raise UsageError("--compile needs a C++ compiler (g++ or clang++) on the PATH for torch.compile on CPU; "
                             "install one (apt install g++) or serve without --compile")
    elif kind == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            raise UsageError("--compile on CUDA needs triton (pip install triton); or serve without --compile")
    else:
        raise UsageError(f"--compile supports cpu and cuda devices, not {kind}; serve without --compile")


def _attention_inputs(layer, h, slot, cos, sin):
    return layer.attention_inputs(h, slot, cos, sin)


def _after_attention(layer, h, out, slot):
    return layer.after_attention(h, out, slot)


class CompiledBlock:
    """``Block.forward_attend`` with its two halves compiled; the attention core stays the caller's."""

    def __init__(self, device):
        check_compile_available(device)
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        self.attention_inputs = torch.compile(_attention_inputs)
        self.after_attention = torch.compile(_after_attention)

    def forward_attend(self, layer, h, slot, cos, sin, attend_fn):
        if h.shape[1] > 1:  # one graph for every multi-token step (a single token keeps its own)
            for t in (h, cos, sin):
                torch._dynamo.mark_dynamic(t, 1)
        q, k, v = self.attention_inputs(layer, h, slot, cos, sin)
        # contiguous: SDPA and the grouped decode attention return different layouts, each its own graph
        out = attend_fn(q, k, v, layer.attn).contiguous()
        if h.shape[1] > 1:
            torch._dynamo.mark_dynamic(out, 2)
        return self.after_attention(layer, h, out, slot)
