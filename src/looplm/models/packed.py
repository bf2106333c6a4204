"""MKL-packed weights: a faster fp32 matmul for inference on CPU at a few rows (decode steps).

A decode step multiplies a handful of rows by every weight of the model, so on CPU it is bound by
how fast the matmul kernel streams weights. MKL's packed GEMM (``cblas_sgemm_pack`` +
``cblas_sgemm_compute``, the path torch.compile's freezing uses for fp32 linears) reorders a weight
once into the kernel's own layout and then streams it faster than ``F.linear`` does at a few rows. One
row keeps ``F.linear``, which is as fast there. The product is the same to float32 rounding (about 1e-6,
as far from float64 as ``F.linear`` is).

Packing is an inference-time copy kept beside the weight, never saved: ``pack_for_cpu(model)``
attaches one to every packable linear and returns the bytes it took; a packed copy is used only when
gradients are off, the input is a float32 CPU tensor and the weight has not changed since it was
packed (its version counter), so training the model afterwards silently falls back to ``F.linear``.
GPU tensors never take this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# MKL chooses the packed layout from the row count it is told at packing time. One copy packed for 64
# rows serves every step size; a layout packed for 1 row is slower than F.linear at a few rows.
PACK_ROWS = 64
enabled = True  # a switch for benchmarks and debugging: False sends every call through F.linear


def mkl_packing_available() -> bool:
    return (
        torch.backends.mkl.is_available()
        and hasattr(torch.ops, "mkl")
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


def _none():
    return None


class PackedWeight:
    """An MKL-packed copy of one [out, in] float32 CPU weight."""

    def __init__(self, weight: torch.Tensor):
        self.source, self.version = weight, weight._version
        self.weight = weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_ROWS)
        self.nbytes = self.weight.numel() * self.weight.element_size()

    # MKL's packed tensor has no storage to copy or pickle: a copied or pickled model comes without its
    # packed copies (an engine packs again)
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _none, ()

    def matches(self, weight: torch.Tensor) -> bool:
        """``weight`` is the very tensor packed, unchanged since (its version counter)."""
        return weight is self.source and weight._version == self.version

    def usable(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Gradients off, not under torch.compile, a float32 CPU input, and ``weight`` matches."""
        return (
            enabled
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.matches(weight)
        )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        y = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), self.packed, self.weight, bias, rows)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None):
    """``F.linear(x, weight, bias)``, through the packed copy when it applies."""
    if packed is not None and x.numel() > x.shape[-1] and packed.usable(x, weight):  # 1 row: F.linear was as fast
        return packed.linear(x, bias)
    return F.linear(x, weight, bias)


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def pack_for_cpu(model: nn.Module) -> int:
    """Attach packed copies to every module with a ``packed`` slot (LoopLinear) and to a plain LM head
    (``model.head_packed``); returns the bytes the copies hold. Copies still valid are kept, so
    calling it again is cheap. No-op off CPU, off float32 or without MKL. (The slot, not the class,
    is what is looked for: layers.py imports this module, so this one must not import it.)"""
    if not mkl_packing_available():
        return 0
    total = 0
    for m in model.modules():
        if hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor) and _packable(m.weight):
            if m.packed is None or not m.packed.matches(m.weight):
                m.packed = PackedWeight(m.weight)
            total += m.packed.nbytes
    head = getattr(model, "lm_head", None)
    if hasattr(model, "head_packed") and type(head) is nn.Linear and head.bias is None and _packable(head.weight):
        if model.head_packed is None or not model.head_packed.matches(head.weight):
            model.head_packed = PackedWeight(head.weight)
        total += model.head_packed.nbytes
    return total


def unpack(model: nn.Module) -> None:
    """Drop every packed copy (frees their memory)."""
    for m in model.modules():  # only packed copies: an int4 weight's kernel layout is also named ``packed``
        if isinstance(getattr(m, "packed", None), PackedWeight):
            m.packed = None
    if isinstance(getattr(model, "head_packed", None), PackedWeight):
        model.head_packed = None
