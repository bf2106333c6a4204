"""How a float32 product of a few rows runs on this CPU: chosen by measuring, not assumed.

A decode step multiplies a handful of rows by every weight of the model, so on CPU its time is how fast
the matrix product streams weights at 1-64 rows. The three ways torch offers for ``x W^T`` do not stream
alike, and which is fastest depends on the machine:

- ``linear``: ``F.linear(x, W)`` (the ``nn.Linear`` path);
- ``packed``: MKL's packed GEMM (``cblas_sgemm_pack`` + ``cblas_sgemm_compute``, the path torch.compile's
  freezing uses for fp32 linears) on a copy of W reordered once into the kernel's layout (kept beside W:
  twice the weight memory);
- ``transposed``: ``(W x^T)^T``, the same product with the weight as the left operand; one row is doubled
  to two, since a two-column product can stream W faster than the one-column (matrix-vector) kernel
  (docs/RESULTS.md, "How a CPU multiplies a few rows").

``prepare_for_cpu(model)`` (a serving engine calls it) times each way on the model's own weights at 1, 2, 4 .. 64
rows, a pass over them per timing (up to ``MEASURED_BYTES``: read from memory as a step reads them, not from
cache), and attaches a ``CpuWeight`` to every linear that follows the fastest way per row count (``CpuPlan``);
the LoRA's products and the LM head get plans of their own. A plan is measured once per process per weight
shapes. Every way gives the same product to float32 rounding. A ``CpuWeight`` is used only when gradients are
off, the input is a float32 CPU tensor, torch.compile is not tracing, and the weight has not changed since (its
version counter): training the model afterwards silently falls back to ``F.linear``. Rows above 64 (prefills)
always take ``F.linear``. GPU tensors never take this path. The copies and plan are never saved.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

FORMS = ("linear", "packed", "transposed")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the row counts timed; a step of n rows follows the smallest bucket >= n
PACK_ROWS = 64  # MKL picks the packed layout for the row count it is told: one copy for 64 rows serves every size
MEASURED_BYTES = 128 * 2**20  # the weights a timing pass reads at most: far beyond any cache, a short pass
enabled = True  # a switch for benchmarks and debugging: False sends every call through F.linear
_plans: dict[tuple, CpuPlan] = {}  # measured plans of this process, by the shapes of the weights timed


def mkl_packing_available() -> bool:
    return (
        torch.backends.mkl.is_available()
        and hasattr(torch.ops, "mkl")
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    )


class CpuPlan:
    """The way a product of n rows runs, per bucket of ``BUCKETS``; ``seconds`` holds the timings it was chosen
    from (bucket -> way -> seconds of a pass over the timed weights)."""

    def __init__(self, forms: dict[int, str], seconds: dict | None = None):
        if set(forms) != set(BUCKETS) or not set(forms.values()) <= set(FORMS):
            raise ValueError(f"a plan names one of {FORMS} for each of the row counts {BUCKETS}")
        self.forms, self.seconds = dict(forms), seconds or {}

    @classmethod
    def uniform(cls, form: str) -> CpuPlan:
        return cls({b: form for b in BUCKETS})

    def form(self, rows: int) -> str:
        for b in BUCKETS:
            if rows <= b:
                return self.forms[b]
        return "linear"

    @property
    def needs_packing(self) -> bool:
        return "packed" in self.forms.values()

    def summary(self) -> str:
        """'1-2 rows transposed, 4-64 linear'-style, for logs and benchmark records."""
        parts, lo = [], 1
        for i, b in enumerate(BUCKETS):
            if i + 1 == len(BUCKETS) or self.forms[BUCKETS[i + 1]] != self.forms[b]:
                parts.append(f"{lo}-{b} rows {self.forms[b]}" if lo != b else f"{b} row{'s' * (b > 1)} {self.forms[b]}")
                lo = b + 1
        return ", ".join(parts)


def _none():
    return None


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as (W x^T)^T, one row doubled to two (see the module docstring)."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        x2 = torch.cat([x2, x2])
    y = (weight @ x2.t()).t()[:rows]
    y = y.contiguous() if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class CpuWeight:
    """One [out, in] float32 CPU weight as a serving engine multiplies it: by its plan's way per row count, with
    an MKL-packed copy when the plan uses one."""

    def __init__(self, weight: torch.Tensor, plan: CpuPlan):
        self.source, self.version = weight, weight._version
        self.weight, self.plan = weight.detach(), plan
        self.packed = (
            torch.ops.mkl._mkl_reorder_linear_weight(self.weight, PACK_ROWS)
            if plan.needs_packing and mkl_packing_available()
            else None
        )
        self.nbytes = self.weight.numel() * self.weight.element_size() if self.packed is not None else 0

    # MKL's packed tensor has no storage to copy or pickle: a copied or pickled model comes without its
    # CPU copies (an engine prepares them again)
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _none, ()

    def matches(self, weight: torch.Tensor) -> bool:
        """``weight`` is the very tensor prepared, unchanged since (its version counter)."""
        return weight is self.source and weight._version == self.version

    def usable(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """``applies(x)`` and ``weight`` matches."""
        return applies(x) and self.matches(weight)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return _product(self.plan.form(rows), x, self.weight, bias, self.packed)


def applies(x: torch.Tensor) -> bool:
    """Gradients off, not under torch.compile, a float32 CPU input."""
    return (
        enabled
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
    )


def lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: CpuPlan | None) -> torch.Tensor:
    """B A x (a LoRA's two small products), the way ``plan`` chose for this many rows where it applies."""
    if plan is None or not applies(x):
        return F.linear(F.linear(x, a), b)
    form = plan.form(x.numel() // x.shape[-1])
    return _product(form, _product(form, x, a, None, None), b, None, None)


def _product(form: str, x, weight, bias, packed) -> torch.Tensor:
    if form == "transposed":
        return transposed(x, weight, bias)
    if form == "packed" and packed is not None:
        rows = x.numel() // x.shape[-1]
        y = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed, weight, bias, rows)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cpu: CpuWeight | None):
    """``F.linear(x, weight, bias)``, the way ``cpu`` chose for this many rows where it applies."""
    if cpu is not None and cpu.usable(x, weight):
        return cpu.linear(x, bias)
    return F.linear(x, weight, bias)


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def _linears(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "cpu_weight") and isinstance(getattr(m, "weight", None), torch.Tensor) and _packable(m.weight)
    ]


def _plain_head(model: nn.Module) -> nn.Linear | None:
    head = getattr(model, "lm_head", None)
    if hasattr(model, "head_cpu_weight") and type(head) is nn.Linear and head.bias is None and _packable(head.weight):
        return head
    return None


@torch.no_grad()
def measure_plan(weights: list[torch.Tensor], rounds: int = 3, forms: tuple[str, ...] = FORMS) -> CpuPlan:
    """Time every way of ``forms`` at every bucket over ``weights`` (up to ``MEASURED_BYTES`` of them),
    interleaved, the median of ``rounds``; the fastest way per bucket. Plans are kept per process by the weights'
    shapes."""
    chosen, total = [], 0
    for w in weights:
        if total and total + w.numel() * 4 > MEASURED_BYTES:
            break
        chosen.append(w)
        total += w.numel() * 4
    forms = tuple(f for f in forms if f != "packed" or mkl_packing_available())
    key = (forms, *(tuple(w.shape) for w in chosen))
    if key in _plans:
        return _plans[key]
    packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS) for w in chosen] if "packed" in forms else None
    gen = torch.Generator().manual_seed(0)  # the caller's random state (a seeded run's sampling) is left alone
    inputs = {d: torch.randn(BUCKETS[-1], d, generator=gen) for d in sorted({w.shape[1] for w in chosen})}
    times: dict[int, dict[str, list[float]]] = {b: {f: [] for f in forms} for b in BUCKETS}
    for r in range(rounds + 1):  # the first round warms the kernels and is not counted
        for b in BUCKETS:
            for f in forms:
                t0 = time.perf_counter()
                for i, w in enumerate(chosen):
                    _product(f, inputs[w.shape[1]][:b], w, None, packs[i] if packs else None)
                if r:
                    times[b][f].append(time.perf_counter() - t0)
    seconds = {b: {f: statistics.median(v) for f, v in times[b].items()} for b in BUCKETS}
    plan = CpuPlan({b: min(seconds[b], key=seconds[b].get) for b in BUCKETS}, seconds)
    _plans[key] = plan
    return plan


def prepare_for_cpu(model: nn.Module) -> tuple[CpuPlan | None, int]:
    """Measure the plans of the model's linears, of their float LoRA (``lora_plan``; a quantized linear's too)
    and of a plain LM head (each its own: their shapes stream differently), and attach a ``CpuWeight`` to each
    float linear and the head; returns the linears' plan and the bytes of MKL-packed copies made. Copies still
    valid are kept, so calling it again is cheap. No-op (None, 0) off CPU or off float32. (Slots, not classes,
    are what is looked for: layers.py imports this module, so this one must not import it.)"""
    linears, head = _linears(model), _plain_head(model)
    loras = [
        m
        for m in model.modules()
        if hasattr(m, "lora_plan") and isinstance(getattr(m, "lora_A", None), torch.Tensor) and _packable(m.lora_A[0])
    ]
    if loras:  # no copies of a LoRA are made: it may be trained further
        lora_plan = measure_plan(
            [w.detach() for m in loras for s in range(m.lora_A.shape[0]) for w in (m.lora_A[s], m.lora_B[s])],
            forms=("linear", "transposed"),
        )
        for m in loras:
            m.lora_plan = lora_plan
    total, plan = 0, None
    if linears:
        plan = measure_plan([m.weight.detach() for m in linears])
        for m in linears:
            if m.cpu_weight is None or not m.cpu_weight.matches(m.weight) or m.cpu_weight.plan is not plan:
                m.cpu_weight = CpuWeight(m.weight, plan)
            total += m.cpu_weight.nbytes
    if head is not None:
        head_plan = measure_plan([head.weight.detach()])
        if (
            model.head_cpu_weight is None
            or not model.head_cpu_weight.matches(head.weight)
            or model.head_cpu_weight.plan is not head_plan
        ):
            model.head_cpu_weight = CpuWeight(head.weight, head_plan)
        total += model.head_cpu_weight.nbytes
    return plan, total


def release(model: nn.Module) -> None:
    """Drop every CPU copy (frees their memory) and plan."""
    for m in model.modules():
        if getattr(m, "lora_plan", None) is not None:
            m.lora_plan = None
        if isinstance(getattr(m, "cpu_weight", None), CpuWeight):
            m.cpu_weight = None
    if isinstance(getattr(model, "head_cpu_weight", None), CpuWeight):
        model.head_cpu_weight = None
