"""One config for every family and every looping setting.

Family differences are plain switches (norm type, MLP type, residual layout, ...), in the manner of
litgpt. Looping is described by four numbers and a name: ``num_hidden_layers`` is the effective
depth L, ``num_loops`` is B, ``prelude_layers`` and ``coda_layers`` are the unique layers before and after
the looped core, and ``sharing`` (the core's pattern) maps each core depth to one of its K shared blocks
(models/plan.py).
"""

from __future__ import annotations

import functools

from transformers import PretrainedConfig

from ..errors import ConfigError
from .exit_adapter import check_exit_adapter
from .plan import DepthPlan, resolve_sharing

LORA_GROUPS = ("q", "kv", "out", "ffn")
NORM_TYPES = ("rms", "rms_plus1", "layer")
# config keys that record where a model came from, not what it computes
PROVENANCE_KEYS = ("conversion", "transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")
# relaxations added after models were made: a model that does not use one has the architecture it always had, so
# that the fingerprints of its teacher caches and resumable runs stay the same
UNUSED = {"loop_scale": False, "magnitude": False}


def architecture(config: PretrainedConfig, ignore: tuple[str, ...] = ()) -> dict:
    """A config as a dict of what decides the model's function: without its provenance (``PROVENANCE_KEYS``),
    the relaxations it does not use (``UNUSED``) and the keys in ``ignore`` (those a caller knows do not matter to
    it)."""
    d = config.to_dict()
    for key in PROVENANCE_KEYS + ignore:
        d.pop(key, None)
    for key, off in UNUSED.items():
        if key in d and d[key] == off:
            del d[key]
    return d


@functools.lru_cache(maxsize=64)
def _plan(num_layers: int, num_loops: int, sharing: str, prelude: int, coda: int, kinds: tuple) -> DepthPlan:
    """Plans are read per step and built from a few numbers: one per distinct config."""
    return DepthPlan(num_layers, num_loops, sharing, prelude, coda, list(kinds))


class LoopLMConfig(PretrainedConfig):
    model_type = "looplm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        family: str = "llama",
        vocab_size: int = 32000,
        hidden_size: int = 256,
        intermediate_size: int = 512,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        mlp_type: str = "glu",
        norm_type: str = "rms",
        norm_eps: float = 1e-6,
        attention_bias: bool = False,
        attention_out_bias: bool | None = None,
        mlp_bias: bool = False,
        parallel_residual: bool = False,
        pre_norms: bool = True,
        sandwich_norms: bool = False,
        qk_norm: bool = False,
        qk_norm_scope: str = "head",
        embedding_multiplier: float | None = None,
        query_pre_attn_scalar: float | None = None,
        attn_logit_softcap: float | None = None,
        final_logit_softcap: float | None = None,
        sliding_window_size: int | None = None,
        depth_attention: list[str] | None = None,
        depth_rope: list[bool] | None = None,
        rope: dict | None = None,
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        add_bos_token: bool = False,
        num_loops: int = 1,
        sharing: str = "cycle",
        prelude_layers: int = 0,
        coda_layers: int = 0,
        per_depth_vectors: bool = False,
        lora_ranks: dict | None = None,
        prefix_length: int = 0,
        loop_scale: bool = False,
        magnitude: bool = False,
        conversion: dict | None = None,
        exit_adapter: dict | None = None,
        **kwargs,
    ):
        self.family = family
        self._set_sizes(vocab_size, hidden_size, intermediate_size, num_hidden_layers)
        self._set_heads(num_attention_heads, num_key_value_heads, head_dim)
        self._set_block(hidden_act, mlp_type, norm_type, norm_eps, attention_bias, attention_out_bias, mlp_bias)
        self._set_norm_layout(parallel_residual, pre_norms, sandwich_norms, qk_norm, qk_norm_scope)
        self._set_scales(embedding_multiplier, query_pre_attn_scalar, attn_logit_softcap, final_logit_softcap)
        self._set_positions(sliding_window_size, depth_attention, depth_rope, rope, max_position_embeddings)
        self.initializer_range = initializer_range
        self.add_bos_token = add_bos_token
        self._set_looping(num_loops, sharing, prelude_layers, coda_layers)
        self._set_relaxation(per_depth_vectors, lora_ranks, prefix_length, loop_scale, magnitude)
        self._set_conversion_and_exits(conversion, exit_adapter)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate()

    # --- __init__'s sections, called in the order the attributes were always set (to_dict() keeps it) ---
    def _set_sizes(self, vocab_size, hidden_size, intermediate_size, num_hidden_layers) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers

    def _set_heads(self, num_attention_heads, num_key_value_heads, head_dim) -> None:
        """Attention heads; None for the key/value heads or the head width: multi-head attention, hidden / heads."""
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or self.hidden_size // num_attention_heads

    def _set_block(
        self, hidden_act, mlp_type, norm_type, norm_eps, attention_bias, attention_out_bias, mlp_bias
    ) -> None:
        """The block's activation, MLP and norm kinds and its linears' biases."""
        self.hidden_act = hidden_act
        self.mlp_type = mlp_type
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.attention_bias = attention_bias  # q, k, v (and o unless attention_out_bias says otherwise)
        # Qwen2 has q/k/v biases and none on o; None: o follows attention_bias.
        self.attention_out_bias = attention_bias if attention_out_bias is None else attention_out_bias
        self.mlp_bias = mlp_bias

    def _set_norm_layout(self, parallel_residual, pre_norms, sandwich_norms, qk_norm, qk_norm_scope) -> None:
        """Where the block's residuals and norms sit."""
        self.parallel_residual = parallel_residual
        # False (OLMo-2): no norm before attention and MLP, only after them (sandwich_norms' post-norms).
        # The block then keeps a per-depth scale (ones) in the pre-norms' place, an exact identity that
        # data-aware init and equalization fold their scales into as they do into a norm.
        self.pre_norms = pre_norms
        self.sandwich_norms = sandwich_norms
        self.qk_norm = qk_norm
        # "head": q/k RMS-normed per head over head_dim (Gemma 3, Qwen3); "all": over the whole q and k
        # projections before the split into heads (OLMo-2).
        self.qk_norm_scope = qk_norm_scope

    def _set_scales(self, embedding_multiplier, query_pre_attn_scalar, attn_logit_softcap, final_logit_softcap) -> None:
        """Gemma's embedding scale, attention scale and logit soft-caps (None: none)."""
        self.embedding_multiplier = embedding_multiplier
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_logit_softcap = attn_logit_softcap
        self.final_logit_softcap = final_logit_softcap

    def _set_positions(self, sliding_window_size, depth_attention, depth_rope, rope, max_position_embeddings) -> None:
        """Per depth, the attention kind and whether it rotates; the rotary settings of each kind."""
        # Named so that transformers' DynamicCache does not turn our per-depth caches into sliding
        # ones: we keep full caches and apply the window in the attention mask.
        self.sliding_window_size = sliding_window_size
        self.depth_attention = list(depth_attention or ["full"] * self.num_hidden_layers)
        # Per depth: whether rotary embeddings apply (False at SmolLM3's NoPE layers). Like the attention
        # kind it belongs to the depth, so a shared layer may rotate at one depth and not at another.
        self.depth_rope = [bool(r) for r in depth_rope] if depth_rope is not None else [True] * self.num_hidden_layers
        # Rotary settings per attention kind: {"full": {...}, "sliding": {...}}, each with
        # theta, type (default | linear | llama3), partial (fraction of head_dim rotated) and
        # the scaling keys of its type.
        self.rope = rope or {"full": {"theta": 10000.0, "type": "default", "partial": 1.0}}
        self.max_position_embeddings = max_position_embeddings

    def _set_looping(self, num_loops, sharing, prelude_layers, coda_layers) -> None:
        self.num_loops = num_loops
        # a named plan (middle-cycle) is stored as its core pattern and ends; checkpoints without ends are P = C = 0
        self.sharing, self.prelude_layers, self.coda_layers = resolve_sharing(
            sharing, int(prelude_layers), int(coda_layers)
        )

    def _set_relaxation(self, per_depth_vectors, lora_ranks, prefix_length, loop_scale, magnitude) -> None:
        """What each depth of a shared block keeps of its own: vectors, LoRA, prefix."""
        # Norm weights and linear biases kept per depth instead of shared: a few thousand numbers,
        # and the only way a full-rank relaxed model reproduces the original exactly.
        self.per_depth_vectors = per_depth_vectors
        self.lora_ranks = {g: int((lora_ranks or {}).get(g, 0)) for g in LORA_GROUPS}
        # Per-depth prefix (paper appendix G): P learned vectors per depth whose keys and values every
        # query of that depth attends to; 0 = none.
        self.prefix_length = prefix_length
        # Mixture-of-Recursions' per-recursion vector: each loop's output (the residual stream) scaled by a vector of
        # its own, initialised to ones (so the conversion stays exact); False: none.
        self.loop_scale = loop_scale
        # DoRA's magnitude: each shared linear's output scaled per depth by a vector, initialised to ones
        self.magnitude = magnitude

    def _set_conversion_and_exits(self, conversion, exit_adapter) -> None:
        """How the model was made, and what serves its intermediate exits."""
        # Free-form record of how the model was made (source, init, ...), for reports.
        self.conversion = conversion or {}
        # An optional adapter per intermediate exit (models/exit_adapter.py): {"kind": "head-lora", "rank": r}
        # or {"kind": "affine"}; None: every exit is the plain final norm + LM head.
        self.exit_adapter = exit_adapter

    # --- derived structure -------------------------------------------------------------------
    @property
    def plan(self) -> DepthPlan:
        """The depth lookup (models/plan.py): block, slot, attention kind and loop of every depth."""
        return _plan(
            self.num_hidden_layers,
            self.num_loops,
            self.sharing,
            self.prelude_layers,
            self.coda_layers,
            tuple(self.depth_attention),
        )

    @property
    def num_shared_layers(self) -> int:
        """K: the shared blocks of the core (every block for a model of one loop)."""
        return self.plan.num_shared if self.num_loops > 1 else self.num_hidden_layers

    @property
    def num_blocks(self) -> int:
        """The blocks the decoder holds: prelude, the core's shared blocks, coda."""
        return self.plan.num_blocks

    @property
    def layer_map(self) -> list[int]:
        return self.plan.layer_map

    @property
    def slot_map(self) -> list[int]:
        return self.plan.slot_map

    def block_slots(self, block: int) -> int:
        """The per-depth rows of block ``block``'s LoRA and prefix: one per depth it runs."""
        return self.plan.block_slots[block]

    def vector_slots(self, block: int) -> int:
        """The rows of a block's norms and biases: one per depth it runs when kept per depth, else one."""
        return self.block_slots(block) if self.per_depth_vectors else 1

    @property
    def is_relaxed(self) -> bool:
        return any(self.lora_ranks.values())

    def validate(self) -> None:
        if self.norm_type not in NORM_TYPES:
            raise ConfigError(f"unknown norm_type {self.norm_type!r}; use one of {NORM_TYPES}")
        if self.mlp_type not in ("glu", "plain"):
            raise ConfigError(f"unknown mlp_type {self.mlp_type!r}; use 'glu' or 'plain'")
        if len(self.depth_attention) != self.num_hidden_layers:
            raise ConfigError(
                f"depth_attention lists {len(self.depth_attention)} depths but the model has "
                f"{self.num_hidden_layers}; give one 'full'/'sliding' entry per depth"
            )
        self.plan  # noqa: B018  (builds the plan: a plan that does not fit fails here, naming the fix)
        if len(self.depth_rope) != self.num_hidden_layers:
            raise ConfigError(
                f"depth_rope lists {len(self.depth_rope)} depths but the model has {self.num_hidden_layers}; "
                "give one true/false entry per depth"
            )
        if self.qk_norm_scope not in ("head", "all"):
            raise ConfigError(f"unknown qk_norm_scope {self.qk_norm_scope!r}; use 'head' or 'all'")
        if "sliding" in self.depth_attention and not self.sliding_window_size:
            raise ConfigError("sliding attention depths need sliding_window_size")
        if self.exit_adapter is not None:
            self.exit_adapter = check_exit_adapter(self.exit_adapter, self.hidden_size)
            if self.num_loops < 2:
                raise ConfigError(
                    "an exit adapter serves the exits after intermediate loops, and this model has "
                    "one loop; convert it with --loops >= 2 first"
                )
        if not isinstance(self.prefix_length, int) or self.prefix_length < 0:
            raise ConfigError(f"prefix_length must be a whole number >= 0, got {self.prefix_length!r}")
        if self.loop_scale and self.plan.loop_end_block is None:
            raise ConfigError(
                f"a loop scale needs a core whose every loop ends at one shared block (a cycle core); "
                f"{self.sharing} with {self.num_loops} loop(s) has none: drop --loop-scale or use --sharing "
                "middle-cycle or cycle"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
