"""One config for every family and every looping setting.

Family differences are plain switches (norm type, MLP type, residual layout, ...), in the manner of
litgpt. Looping is described by three numbers and a name: ``num_hidden_layers`` is the effective
depth L, ``num_loops`` is B, ``sharing`` maps each depth to one of the K = L / B shared layers.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..errors import ConfigError
from .exit_adapter import check_exit_adapter

LORA_GROUPS = ("q", "kv", "out", "ffn")
SHARING_STRATEGIES = ("cycle", "sequence", "cycle-rev")
NORM_TYPES = ("rms", "rms_plus1", "layer")
# config keys that record where a model came from, not what it computes
PROVENANCE_KEYS = ("conversion", "transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype")


def architecture(config: PretrainedConfig, ignore: tuple[str, ...] = ()) -> dict:
    """A config as a dict of what decides the model's function: without its provenance (``PROVENANCE_KEYS``)
    and without the keys in ``ignore`` (those a caller knows do not matter to it)."""
    d = config.to_dict()
    for key in PROVENANCE_KEYS + ignore:
        d.pop(key, None)
    return d


def layer_map(num_layers: int, num_loops: int, sharing: str = "cycle") -> list[int]:
    """s(d): the shared layer that depth d runs, for d = 0..L-1."""
    if num_loops < 1 or num_layers % num_loops:
        raise ConfigError(
            f"--loops {num_loops} does not divide the model's {num_layers} layers; "
            f"pick one of {[b for b in range(1, num_layers + 1) if num_layers % b == 0]}"
        )
    k = num_layers // num_loops
    if sharing == "cycle":
        return [d % k for d in range(num_layers)]
    if sharing == "sequence":
        return [d // num_loops for d in range(num_layers)]
    if sharing == "cycle-rev":  # Takase & Kasai: cycle, then only the last block in reverse order
        return [d % k if d < num_layers - k else k - 1 - d % k for d in range(num_layers)]
    raise ConfigError(f"unknown sharing strategy {sharing!r}; use one of {', '.join(SHARING_STRATEGIES)}")


def slot_map(layers: list[int]) -> list[int]:
    """For each depth, how many earlier depths run the same shared layer: its index into that layer's
    per-depth parameters (LoRA stacks, per-depth norms). For cycle sharing this is the loop index."""
    seen: dict[int, int] = {}
    slots = []
    for k in layers:
        slots.append(seen.get(k, 0))
        seen[k] = slots[-1] + 1
    return slots


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
        per_depth_vectors: bool = False,
        lora_ranks: dict | None = None,
        prefix_length: int = 0,
        conversion: dict | None = None,
        exit_adapter: dict | None = None,
        **kwargs,
    ):
        self.family = family
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.mlp_type = mlp_type
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.attention_bias = attention_bias  # q, k, v (and o unless attention_out_bias says otherwise)
        # Qwen2 has q/k/v biases and none on o; None: o follows attention_bias.
        self.attention_out_bias = attention_bias if attention_out_bias is None else attention_out_bias
        self.mlp_bias = mlp_bias
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
        self.embedding_multiplier = embedding_multiplier
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_logit_softcap = attn_logit_softcap
        self.final_logit_softcap = final_logit_softcap
        # Named so that transformers' DynamicCache does not turn our per-depth caches into sliding
        # ones: we keep full caches and apply the window in the attention mask.
        self.sliding_window_size = sliding_window_size
        self.depth_attention = list(depth_attention or ["full"] * num_hidden_layers)
        # Per depth: whether rotary embeddings apply (False at SmolLM3's NoPE layers). Like the attention
        # kind it belongs to the depth, so a shared layer may rotate at one depth and not at another.
        self.depth_rope = [bool(r) for r in depth_rope] if depth_rope is not None else [True] * num_hidden_layers
        # Rotary settings per attention kind: {"full": {...}, "sliding": {...}}, each with
        # theta, type (default | linear | llama3), partial (fraction of head_dim rotated) and
        # the scaling keys of its type.
        self.rope = rope or {"full": {"theta": 10000.0, "type": "default", "partial": 1.0}}
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.add_bos_token = add_bos_token
        self.num_loops = num_loops
        self.sharing = sharing
        # Norm weights and linear biases kept per depth instead of shared: a few thousand numbers,
        # and the only way a full-rank relaxed model reproduces the original exactly.
        self.per_depth_vectors = per_depth_vectors
        self.lora_ranks = {g: int((lora_ranks or {}).get(g, 0)) for g in LORA_GROUPS}
        # Per-depth prefix (paper appendix G): P learned vectors per depth whose keys and values every
        # query of that depth attends to; 0 = none.
        self.prefix_length = prefix_length
        # Free-form record of how the model was made (source, init, ...), for reports.
        self.conversion = conversion or {}
        # An optional adapter per intermediate exit (models/exit_adapter.py): {"kind": "head-lora", "rank": r}
        # or {"kind": "affine"}; None: every exit is the plain final norm + LM head.
        self.exit_adapter = exit_adapter
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate()

    # --- derived structure -------------------------------------------------------------------
    @property
    def num_shared_layers(self) -> int:
        return self.num_hidden_layers // self.num_loops

    @property
    def layer_map(self) -> list[int]:
        return layer_map(self.num_hidden_layers, self.num_loops, self.sharing)

    @property
    def slot_map(self) -> list[int]:
        return slot_map(self.layer_map)

    @property
    def num_vector_slots(self) -> int:
        return self.num_loops if self.per_depth_vectors else 1

    @property
    def is_relaxed(self) -> bool:
        return any(self.lora_ranks.values())

    def validate(self) -> None:
        if self.norm_type not in NORM_TYPES:
            raise ConfigError(f"unknown norm_type {self.norm_type!r}; use one of {NORM_TYPES}")
        if self.mlp_type not in ("glu", "plain"):
            raise ConfigError(f"unknown mlp_type {self.mlp_type!r}; use 'glu' or 'plain'")
        if self.sharing not in SHARING_STRATEGIES:
            raise ConfigError(f"unknown sharing {self.sharing!r}; use one of {SHARING_STRATEGIES}")
        layer_map(self.num_hidden_layers, self.num_loops, self.sharing)
        if len(self.depth_attention) != self.num_hidden_layers:
            raise ConfigError(
                f"depth_attention lists {len(self.depth_attention)} depths but the model has "
                f"{self.num_hidden_layers}; give one 'full'/'sliding' entry per depth"
            )
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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
