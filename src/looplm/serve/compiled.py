"""A compiled engine step (``Engine(compile=True)``, ``--compile``): torch.compile regions around attention.

At batch 1 with quantized weights the weight matmuls are the smaller part of a token's time: the rest is
dozens of small operators per layer (norms, rotary, casts, residuals) and the Python between them. Here each shared
layer's work before its attention core (norm,
q/k/v projections with per-depth LoRA, q/k norms, rotary) and after it (output projection, residuals, MLP)
runs as one compiled region each: inductor fuses the elementwise work into a few C++ kernels and one call
replaces the Python between them. The attention core (cache writes and reads, SDPA) stays the engine's
own eager code, so the cache layout, the in-place reads and the masks are unchanged.

A decode step in which cache row i holds the step's token i for every row (batch 1, or every row busy at one
loop) goes further: each loop is one compiled call (``decode_loop``) that runs every layer, the cache writes
and the in-place attention reads included, with the cache tensors as graph inputs mutated in place. That
removes the eager attention core and the Python between layers from the batch-1 token. Those calls skip
dynamo's guards on the modules they read, and on CPU their wrapper is C++ (``_decode_loop_options``).

The KV entries an early-exited token skipped (kv mode ``copy``) are filled by one compiled call per exit
(``fill_kv``): every skipped depth's k/v projections and cache writes. Eager, those many small projections
are a large share of a looped batch-1 token.

Other steps are regional: every layer runs the same compiled code (its parameters are graph inputs, not
constants), so compiling costs one layer's graphs, not L of them. Graphs are specialised on a step of one
token (batch-1 decode) and dynamic in the token count otherwise, and on the quantized/float kind of the
weights; ``schedulers.warm_up`` compiles them ahead of serving. Only single-depth steps take the compiled path: a step
mixing depths (depth-wise batching with exits) groups its LoRA by depth with data-dependent indexing,
which would break the graph, so it runs eagerly as before.

Weights: no MKL-packed copies (MKL's packed tensor cannot be traced; models/packed.py steps aside under
compilation), so a compiled float32 engine multiplies with inductor's own kernels; int8/int4 weights use the
same PyTorch ops as the eager engine (models/quantized.py), except int8's one-row products, which inductor compiles
as a reduction in several weight streams (``quantized.int8_gemv``). So a quantized engine's batch-1 head (int8 under
both formats) also runs compiled: the final norm, the head and its exact rescoring in one graph (``exit_logits``).
"""

from __future__ import annotations

import types

import torch

from ..util import check_compile_available


def _attention_inputs(layer, h, slot, cos, sin):
    return layer.attention_inputs(h, slot, cos, sin)


def _after_attention(layer, h, out, slot):
    return layer.after_attention(h, out, slot)


def _decode_loop(layers, slots, kinds, depths, h, tables, cache, pos, masks):
    """One loop of a decode step in which cache row i holds the step's token i for every row (batch 1, or
    every row busy at one loop): each layer's projections, cache write, attention over its depth's rows
    read in place, and MLP. The cache's tensors are graph inputs written in place (its own ``write`` and
    ``depth_rows``, traced)."""
    rows = torch.arange(h.shape[1], device=h.device)
    for layer, slot, kind, d in zip(layers, slots, kinds, depths):
        cos, sin = tables[kind]
        q, k, v = layer.attention_inputs(h, slot, cos, sin)
        cache.write(cache.flat(d, rows), pos, k[0].transpose(0, 1), v[0].transpose(0, 1))
        mask = masks[kind]
        kk, vv = cache.depth_rows(d, mask.shape[-1] - cache.prefix_len)
        o = layer.attn.attend_one(q[0].transpose(0, 1).unsqueeze(2), kk, vv, mask)
        h = layer.after_attention(h, o.squeeze(2).transpose(0, 1).unsqueeze(0), slot)
    return h


def _fill_kv(layers, slots, kinds, depths, h, tables, cache, rows, pos):
    """The cache entries of the depths an early-exited token skipped (kv mode ``copy``): each skipped depth's
    k/v projections of the exit state h [1, n, hidden], written at the tokens' cache rows and positions."""
    for layer, slot, kind, d in zip(layers, slots, kinds, depths):
        cos, sin = tables[kind]
        k, v = layer.project_kv(h, slot, cos, sin)
        cache.write(cache.flat(d, rows), pos, k[0].transpose(0, 1), v[0].transpose(0, 1))


def _exit_logits(model, h, loop):
    return model.exit_logits(h, loop)


def _own_copy(fn):
    """``fn`` with a code object of its own: dynamo keeps compiled graphs per code object, so graphs compiled
    through this copy are never offered to another caller's arguments."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _decode_loop_options(device) -> dict:
    """The whole-loop graph runs without dynamo's guards on the modules it reads. Checking them is a visible
    share of a batch-1 token (hundreds of parameters and module attributes, on every call). Dropping them is safe
    here: an engine's model is frozen for the engine's life, each
    engine compiles its own copy of the function (``_own_copy``), and the guards on the call's own arguments
    (depths, slots, kinds, shapes, the cache) stay, so loops and shapes still get their own graphs. On CPU the
    graph's wrapper is C++ (``cpp_wrapper``): the hundreds of kernel and matmul calls of a token skip Python."""
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if torch.device(device).type == "cpu":
        options["cpp_wrapper"] = True
    return options


class CompiledBlock:
    """``Block.forward_attend`` with its two halves compiled; the attention core stays the caller's."""

    def __init__(self, device):
        check_compile_available(device)  # and raises dynamo's recompile limit
        self.attention_inputs = torch.compile(_attention_inputs)
        self.after_attention = torch.compile(_after_attention)
        self.decode_loop_fn = torch.compile(_own_copy(_decode_loop), options=_decode_loop_options(device))
        self.fill_kv_fn = torch.compile(_own_copy(_fill_kv), options=_decode_loop_options(device))
        self.exit_logits_fn = torch.compile(_own_copy(_exit_logits), options=_decode_loop_options(device))

    def decode_loop(self, layers, slots, kinds, depths, h, tables, cache, pos, masks):
        """``_decode_loop`` compiled: one graph per loop of the model, dynamic in the cache length read."""
        for m in masks.values():
            if m.shape[-1] > 1:
                torch._dynamo.mark_dynamic(m, 3)
        return self.decode_loop_fn(layers, slots, kinds, depths, h, tables, cache, pos, masks)

    def fill_kv(self, layers, slots, kinds, depths, h, tables, cache, rows, pos):
        """``_fill_kv`` compiled: one graph per exit loop for one token, one dynamic in the token count."""
        if h.shape[1] > 1:
            for t in (h, *(x for cs in tables.values() for x in cs)):
                torch._dynamo.mark_dynamic(t, 1)
            for t in (rows, pos):
                torch._dynamo.mark_dynamic(t, 0)
        self.fill_kv_fn(layers, slots, kinds, depths, h, tables, cache, rows, pos)

    def exit_logits(self, model, h, loop):
        """``model.exit_logits`` of one row compiled: the final norm and the LM head in one graph, in which an int8
        head's product is the streamed reduction (models/quantized.py ``int8_gemv``), 28 MB for SmolLM2."""
        return self.exit_logits_fn(model, h, loop)

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
