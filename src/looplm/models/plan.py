"""The sharing plan: which block each of the L depth positions runs, and with which per-depth parameters.

A plan splits the depths into a prelude of P unique layers, a core of K shared blocks looped B times, and a coda
of C unique layers (Huginn's and retrofitted recurrence's prelude / core / coda; Mixture-of-Recursions'
middle-cycle is P = C = 1). The paper's plans (cycle, sequence, cycle-rev) are P = C = 0. Where B does not divide
the L - P - C core depths, the remainder joins the coda as unique layers, so that full rank stays exact.

``DepthPlan`` is the one depth lookup of the code base: the decoder, the engine, the compiled loop, conversion,
healing and export all read "block, slot, attention kind and loop of depth d" from it. An exit after loop i of
the core runs the prelude, loops 0..i of the core, then the coda (``path``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..errors import ConfigError

CORE_PATTERNS = ("cycle", "sequence", "cycle-rev")
# plans with a name of their own (Mixture-of-Recursions'): a core pattern with one unique layer at each end
NAMED_PLANS = {"middle-cycle": ("cycle", 1, 1), "middle-sequence": ("sequence", 1, 1)}
SHARING_STRATEGIES = CORE_PATTERNS + tuple(NAMED_PLANS)


class MixedAttentionError(ConfigError):
    """A plan whose shared block would run depths of two attention kinds (refused: see _check_attention_kinds)."""


@dataclass(frozen=True)
class Depth:
    """One depth position: ``index`` d (its KV-cache entry and the original layer it stands for), the ``block``
    of ``model.layers`` that runs it, its ``slot`` among that block's depths (per-depth LoRA, norms, prefix),
    its attention ``kind`` and, in the core, its ``loop`` (None in the prelude and the coda)."""

    index: int
    block: int
    slot: int
    kind: str
    loop: int | None

    @property
    def in_core(self) -> bool:
        return self.loop is not None


def core_map(num_core: int, num_loops: int, pattern: str) -> list[int]:
    """The shared block (0..K-1) that core position j runs, for j = 0..K*B-1."""
    k = num_core // num_loops
    if pattern == "cycle":
        return [j % k for j in range(num_core)]
    if pattern == "sequence":
        return [j // num_loops for j in range(num_core)]
    if pattern == "cycle-rev":  # Takase & Kasai: cycle, then only the last block in reverse order
        return [j % k if j < num_core - k else k - 1 - j % k for j in range(num_core)]
    raise ConfigError(f"unknown sharing {pattern!r}; use one of {', '.join(SHARING_STRATEGIES)}")


def resolve_sharing(sharing: str, prelude: int, coda: int) -> tuple[str, int, int]:
    """(core pattern, P, C) of a sharing name: middle-cycle is cycle with at least one unique layer at each end."""
    if sharing in NAMED_PLANS:
        pattern, p, c = NAMED_PLANS[sharing]
        return pattern, max(prelude, p), max(coda, c)
    if sharing not in CORE_PATTERNS:
        raise ConfigError(f"unknown sharing {sharing!r}; use one of {', '.join(SHARING_STRATEGIES)}")
    return sharing, prelude, coda


class DepthPlan:
    """The depth lookup of one model: ``depths[d]`` for every depth, the blocks' slot counts, and the paths of
    every exit."""

    def __init__(
        self,
        num_layers: int,
        num_loops: int = 1,
        sharing: str = "cycle",
        prelude: int = 0,
        coda: int = 0,
        depth_attention: list[str] | None = None,
    ):
        pattern, prelude, coda = resolve_sharing(sharing, prelude, coda)
        L, B = num_layers, num_loops
        if B < 1:
            raise ConfigError(f"--loops must be at least 1, got {B}")
        if prelude < 0 or coda < 0:
            raise ConfigError(f"--prelude and --coda count layers: give whole numbers >= 0 (got {prelude}, {coda})")
        core = L - prelude - coda
        if core < B:
            raise ConfigError(
                f"a prelude of {prelude} and a coda of {coda} unique layers ({sharing}) leave {max(core, 0)} of the "
                f"model's {L} layers to loop {B} times; keep at least {B} in the core (--prelude + --coda <= "
                f"{L - B}), or fewer --loops"
            )
        if B > 1 and prelude == coda == 0 and L % B:
            raise ConfigError(
                f"--loops {B} does not divide the model's {L} layers; pick one of "
                f"{[b for b in range(1, L + 1) if L % b == 0]}, or keep the remainder unique with --coda {L % B}"
            )
        coda += core % B  # the remainder stays unique, at the end of the core
        core -= core % B
        self.num_layers, self.num_loops, self.pattern = L, B, pattern
        self.prelude_layers, self.coda_layers = prelude, coda
        self.num_shared = core // B if B > 1 else 0
        kinds = list(depth_attention or ["full"] * L)
        shared = core_map(core, B, pattern) if B > 1 else []
        depths = []
        for d in range(L):
            j = d - prelude
            if B > 1 and 0 <= j < core:
                block, loop = prelude + shared[j], j // self.num_shared
            else:
                block = d if d < prelude or B == 1 else d - core + self.num_shared
                loop = None if B > 1 else 0
            depths.append((d, block, loop))
        # a depth's slot: how many earlier depths run the same block (its row of the block's per-depth parameters)
        seen: dict[int, int] = {}
        self.depths: list[Depth] = []
        for d, block, loop in depths:
            slot = seen.get(block, 0)
            seen[block] = slot + 1
            self.depths.append(Depth(d, block, slot, kinds[d], loop))
        self.block_slots = [seen[b] for b in range(len(seen))]
        self._check_attention_kinds()

    def _check_attention_kinds(self) -> None:
        """A plan with unique layers keeps one attention kind per shared block (Gemma's 5:1 sliding/full pattern):
        a block shared by a sliding-window depth and a full-attention depth has to serve two position encodings
        and two reaches at once. The paper's plans (no prelude, no coda) keep what they always did, the kind
        going with the depth, so that their checkpoints (Gemma-3 at B=2, Qwen2's sliding layers) keep loading."""
        if not self.has_ends:
            return
        first: dict[int, Depth] = {}
        for dep in self.depths:
            other = first.setdefault(dep.block, dep)
            if other.kind != dep.kind:
                raise MixedAttentionError(
                    f"this sharing plan runs shared block {dep.block} at depth {other.index} ({other.kind} attention) "
                    f"and depth {dep.index} ({dep.kind}): a shared block must keep one attention kind. Choose --loops, "
                    "--prelude and --coda so that the core's K shared layers are a whole number of the model's "
                    "attention periods, or another --sharing"
                )

    # --- structure ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.block_slots)

    @property
    def looped(self) -> bool:
        return self.num_loops > 1

    def is_unique(self, block: int) -> bool:
        """A block that runs one depth: one of the original's layers, kept as it was (no LoRA)."""
        return self.block_slots[block] == 1 and self.looped

    @cached_property
    def block_depths(self) -> list[list[int]]:
        """For each block, the depths that run it, in slot order."""
        out: list[list[int]] = [[] for _ in self.block_slots]
        for dep in self.depths:
            out[dep.block].append(dep.index)
        return out

    @cached_property
    def shared_blocks(self) -> list[int]:
        return [b for b in range(self.num_blocks) if not self.is_unique(b)]

    @property
    def layer_map(self) -> list[int]:
        """The block each depth runs (the paper's s(d) for P = C = 0)."""
        return [dep.block for dep in self.depths]

    @property
    def slot_map(self) -> list[int]:
        return [dep.slot for dep in self.depths]

    # --- paths --------------------------------------------------------------------------------
    @cached_property
    def prelude(self) -> list[Depth]:
        return self.depths[: self.prelude_layers] if self.looped else []

    @cached_property
    def coda(self) -> list[Depth]:
        return self.depths[self.num_layers - self.coda_layers :] if self.looped else []

    def loop(self, i: int) -> list[Depth]:
        """The core depths of loop i (0-based); for a model of one loop, every depth."""
        if not self.looped:
            return list(self.depths)
        start = self.prelude_layers + i * self.num_shared
        return self.depths[start : start + self.num_shared]

    def path(self, loops: int | None = None) -> list[Depth]:
        """The depths an exit after ``loops`` loops of the core runs, in order: prelude, those loops, coda."""
        loops = self.num_loops if loops is None else loops
        out = list(self.prelude)
        for i in range(loops):
            out += self.loop(i)
        return out + self.coda

    @property
    def has_ends(self) -> bool:
        """Whether unique layers run before or after the core (then an exit is more than the core's state)."""
        return self.looped and bool(self.prelude_layers or self.coda_layers)

    @property
    def mixable(self) -> bool:
        """Whether loop i runs block P + k at its k-th step for every i (cycle cores): then one batched call of
        the core's k-th block serves items at different loops, each with its own slot."""
        if not self.looped:
            return True
        return all(
            self.loop(i)[k].block == self.loop(0)[k].block
            for i in range(self.num_loops)
            for k in range(self.num_shared)
        )

    @cached_property
    def loop_end_block(self) -> int | None:
        """The shared block that ends every loop of the core, at slot i in loop i (a cycle core's last block):
        where a loop scale (``loop_scale``) multiplies each loop's output; None where the loops end elsewhere."""
        if not self.looped:
            return None
        ends = [self.loop(i)[-1] for i in range(self.num_loops)]
        if any(e.block != ends[0].block or e.slot != i for i, e in enumerate(ends)):
            return None
        return ends[0].block

    def describe(self) -> str:
        """One line for `looplm info`: e.g. '1 + 14 x 2 + 1 (cycle core)'."""
        if not self.looped:
            return f"{self.num_layers} layers, no loop"
        return (
            f"{self.prelude_layers} + {self.num_shared} x {self.num_loops} + {self.coda_layers} ({self.pattern} core)"
        )
