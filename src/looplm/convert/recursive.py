"""Vanilla model -> Recursive Transformer -> Relaxed Recursive Transformer (paper sections 2.2-2.3).

``convert`` builds a looped model from a vanilla (B = 1) looplm model by a sharing plan (models/plan.py): a
prelude and a coda of unique layers, copied from the original exactly, around a core of K shared blocks looped B
times:
1. choose, per shared block k, the pretrained depths tied to it (the plan);
2. initialise the shared weights from them (Stepwise, Average, Lower, Upper or Random);
3. initialise norm weights (tied: avg, choice, zero; or kept per depth); by default they follow the
   init: a selecting init (Stepwise, Lower) copies the norms of the layer it copies, Average and aware
   average them, Random keeps fresh ones (it uses no pretrained weight at all, paper appendix E);
4. optionally add a LoRA per depth, initialised by truncated SVD of W_d - W'_k (or zero init);
5. optionally add a prefix per depth (appendix G): P learned vectors whose keys and values every query
   of that depth attends to, initialised small and random (N(0, initializer_range^2)).
"""

from __future__ import annotations

import copy
import time

import torch

from ..models import LORA_GROUPS, ConfigError, LoopLMConfig, LoopLMForCausalLM
from ..models.layers import DepthNorm, LoopLinear
from ..models.plan import DepthPlan

INITS = ("stepwise", "stepwise-start", "average", "lower", "upper", "random", "aware")
NORMS = ("tied-avg", "tied-choice", "tied-zero", "per-depth")
SELECTING_INITS = ("stepwise", "stepwise-start", "lower", "upper")
LORA_INITS = ("svd", "zero", "aware-svd")
# Which linears each LoRA rank group covers (paper appendix F: Q, KV, Out, FFN).
GROUP_OF = {
    "q_proj": "q",
    "k_proj": "kv",
    "v_proj": "kv",
    "o_proj": "out",
    "gate_proj": "ffn",
    "up_proj": "ffn",
    "down_proj": "ffn",
}


def stepwise_layers(num_layers: int, num_shared: int, fixed_ends: bool = True) -> list[int]:
    """The pretrained layer each shared layer copies under Stepwise init. Fixed-ends keeps the first
    and last layer and spaces the rest evenly; fixed-start takes layer 0 and then every B-th."""
    if num_shared == 1:
        return [0]
    if fixed_ends:
        return [round(k * (num_layers - 1) / (num_shared - 1)) for k in range(num_shared)]
    step = num_layers // num_shared
    return [k * step for k in range(num_shared)]


def default_norms(init: str) -> str:
    """The norm rule that matches the init: norms come from where the linears come from. The paper
    selects layers for Stepwise and Lower (so their norms too) and averages for Average. Random's norms
    are fresh whatever the rule; tied is its shape."""
    return "tied-choice" if init in SELECTING_INITS else "tied-avg"


def parse_lora_ranks(text: str | None, rank: int | str | None) -> dict:
    """--lora-ranks q=128,kv=64,out=128,ffn=256 (unnamed groups get --lora-rank), or one rank for all.
    A rank may be 'full': the module's min(in, out)."""
    base = {g: rank or 0 for g in LORA_GROUPS}
    if text:
        for part in text.split(","):
            if "=" not in part:
                raise ConfigError(f"bad --lora-ranks entry {part!r}; write e.g. q=128,kv=64,out=128,ffn=256")
            key, value = (s.strip() for s in part.split("=", 1))
            if key not in LORA_GROUPS:
                raise ConfigError(f"unknown LoRA group {key!r} in --lora-ranks; groups are {', '.join(LORA_GROUPS)}")
            base[key] = value
    out = {}
    for g, v in base.items():
        if v == "full":
            out[g] = "full"
            continue
        try:
            out[g] = int(v)
        except (TypeError, ValueError):
            raise ConfigError(f"LoRA rank {v!r} for group {g} is not a whole number or 'full'") from None
        if out[g] < 0:
            raise ConfigError(f"LoRA rank for group {g} is negative ({v}); use 0 for no LoRA")
    return out


def _resolve_ranks(config: LoopLMConfig, ranks: dict) -> tuple[dict, dict]:
    """Each group's rank, capped at its linears' min(in, out) ('full' is that cap), and the caps applied
    as {group: [asked, used]}. A rank above the cap adds nothing: the paper's rank-512 Gemma and TinyLlama
    N-emb counts only add up with the KV LoRA capped at its 256-wide output."""
    c = config
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    limits = {
        "q": min(c.hidden_size, q_out),
        "kv": min(c.hidden_size, kv_out),
        "out": min(q_out, c.hidden_size),
        "ffn": min(c.hidden_size, c.intermediate_size),
    }
    resolved, capped = {}, {}
    for g in LORA_GROUPS:
        r = ranks.get(g, 0)
        r = limits[g] if r == "full" else int(r)
        if r > limits[g]:
            capped[g] = [r, limits[g]]
        resolved[g] = min(r, limits[g])
    return resolved, capped


def tied_depths(config: LoopLMConfig) -> list[list[int]]:
    """For each block of the plan, the depths that run it, in slot order (one depth for a unique block)."""
    return config.plan.block_depths


def selected_layers(config: LoopLMConfig, init: str) -> list[int] | None:
    """The pretrained layer each shared block of the core copies under a selecting init, or None for the others:
    Stepwise spreads them over the core's depths keeping its ends (MoR's middle plans: layers 1 and L-2), its
    fixed-start variant takes the core's first and then every B-th, Lower the core's first K, Upper its last K."""
    plan = config.plan
    K, start, stop = plan.num_shared, plan.prelude_layers, plan.num_layers - plan.coda_layers
    if init == "stepwise":
        return [start + d for d in stepwise_layers(stop - start, K, True)]
    if init == "stepwise-start":
        return [start + d for d in stepwise_layers(stop - start, K, False)]
    if init == "lower":
        return list(range(start, start + K))
    if init == "upper":
        return list(range(stop - K, stop))
    return None


def equal_nemb_rank(vanilla: LoopLMForCausalLM, plan: DepthPlan, reference_rank: int = 64) -> int:
    """The largest per-depth LoRA rank at which ``plan``'s N-emb stays at most that of the paper's cycle plan at
    ``reference_rank`` with the same loops: a unique layer costs a whole layer's weights, which the shared
    blocks' LoRAs give back in rank (SmolLM2-135M at B=2: middle-cycle's one extra layer is 8 ranks' worth)."""
    layer = vanilla.model.layers[0]
    weights = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in _linears(layer).values())
    per_rank = sum(m.in_features + m.out_features for m in _linears(layer).values())  # one depth's LoRA, rank 1
    L, B = plan.num_layers, plan.num_loops
    cycle = DepthPlan(L, B, "cycle", 0, L % B if B > 1 else 0)

    def lora_depths(p: DepthPlan) -> int:
        return sum(p.block_slots[b] for b in p.shared_blocks)

    budget = (cycle.num_blocks - plan.num_blocks) * weights + reference_rank * per_rank * lora_depths(cycle)
    return max(0, budget // (per_rank * lora_depths(plan))) if lora_depths(plan) else 0


def _linears(block) -> dict[str, LoopLinear]:
    return {n: m for n, m in block.named_modules() if isinstance(m, LoopLinear)}


def _norms(block) -> dict[str, DepthNorm]:
    """A block's norms, the original's layers have too (not the loop scale, which starts at ones)."""
    return {n: m for n, m in block.named_modules() if isinstance(m, DepthNorm) and n != "loop_scale"}


def svd_factors(residual: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B = U_r S_r, A = V_r^T from the truncated SVD of ``residual`` [out, in].

    Full SVD in float64 when the rank is a large part of the spectrum (so that full rank restores the
    weight to float32 precision); a randomised SVD (Halko et al.) otherwise, which is much faster."""
    small = min(residual.shape)
    if rank * 4 >= small:
        U, S, Vh = torch.linalg.svd(residual.double(), full_matrices=False)
        U, S, Vh = U[:, :rank], S[:rank], Vh[:rank]
    else:
        U, S, V = torch.svd_lowrank(residual.double(), q=min(rank + 16, small), niter=4)
        U, S, Vh = U[:, :rank], S[:rank], V[:, :rank].T
    return (U * S).to(residual.dtype), Vh.to(residual.dtype)


def _derived_config(config: LoopLMConfig, **changes) -> LoopLMConfig:
    """A copy of ``config`` with ``changes`` applied (transformers' bookkeeping keys dropped)."""
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        fields.pop(key, None)
    return LoopLMConfig(**{**fields, **changes})


@torch.no_grad()
def convert(
    vanilla: LoopLMForCausalLM,
    loops: int = 2,
    strategy: str = "cycle",
    init: str = "average",
    norms: str | None = None,
    lora_ranks: dict | int | str = 0,
    lora_init: str = "svd",
    seed: int = 0,
    calibration=None,
    prefix_length: int = 0,
    prelude: int = 0,
    coda: int = 0,
    loop_scale: bool = False,
    magnitude: bool = False,
) -> LoopLMForCausalLM:
    """A Recursive (rank 0) or Relaxed Recursive Transformer initialised from a vanilla model, relaxed by
    per-depth LoRA (``lora_ranks``), per-depth prefixes (``prefix_length``, paper appendix G) or both, and
    optionally a loop scale (``loop_scale``: Mixture-of-Recursions' per-recursion vector) and a magnitude per depth
    on every shared linear (``magnitude``: DoRA's), both ones at first.

    ``strategy`` is the core's pattern or a named plan (middle-cycle); ``prelude`` and ``coda`` keep that many of
    the original's first and last layers unique, exactly as they were. ``norms`` None follows the init
    (``default_norms``). ``calibration`` (an ``aware.Calibration`` of
    the vanilla model) is needed by init "aware" and lora_init "aware-svd" (convert/aware.py)."""
    src_cfg = vanilla.config
    norms = _check_options(src_cfg, init, norms, lora_init, prefix_length)
    if not isinstance(lora_ranks, dict):
        lora_ranks = parse_lora_ranks(None, lora_ranks)
    from . import aware

    aware.check_calibration(calibration, src_cfg, init, lora_init, lora_ranks)
    torch.manual_seed(seed)
    started = time.perf_counter()
    relax = {"prefix_length": prefix_length, "loop_scale": loop_scale, "magnitude": magnitude}
    config = _looped_config(src_cfg, loops, strategy, prelude, coda, init, norms, lora_ranks, lora_init, relax)
    model = LoopLMForCausalLM(config).to(next(vanilla.parameters()).dtype)
    if init != "random":  # the paper's Random baseline uses no pretrained weight at all, embeddings included
        _copy_outer(vanilla, model)
        _init_layers(vanilla, model, init, norms, lora_init, calibration)
    model.config.conversion["seconds"] = round(time.perf_counter() - started, 3)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _check_options(src_cfg: LoopLMConfig, init: str, norms: str | None, lora_init: str, prefix_length) -> str:
    """Refuse a source model convert cannot take and unknown options; returns the norm rule (``norms`` or the
    init's default)."""
    if src_cfg.num_loops != 1:
        raise ConfigError("convert takes a vanilla model (num_loops = 1); this one is already recursive")
    if src_cfg.prefix_length:
        raise ConfigError("convert takes a model without prefixes; convert the original model instead")
    if not isinstance(prefix_length, int) or prefix_length < 0:
        raise ConfigError(f"prefix length must be a whole number >= 0, got {prefix_length!r}")
    if init not in INITS:
        raise ConfigError(f"unknown --init {init!r}; use one of {', '.join(INITS)}")
    norms = norms or default_norms(init)
    if norms not in NORMS:
        raise ConfigError(f"unknown --norms {norms!r}; use one of {', '.join(NORMS)}")
    if lora_init not in LORA_INITS:
        raise ConfigError(f"unknown --lora-init {lora_init!r}; use one of {', '.join(LORA_INITS)}")
    return norms


def _looped_config(
    src_cfg: LoopLMConfig, loops, strategy, prelude, coda, init, norms, lora_ranks: dict, lora_init, relax: dict
) -> LoopLMConfig:
    """The looped model's config: the source's with the plan and relaxation asked for (``relax``: the prefix length,
    the loop scale and the magnitude), LoRA ranks capped at what their linears can use, and the record of the
    conversion (``conversion``) that reports show."""
    config = _derived_config(
        src_cfg,
        num_loops=loops,
        sharing=strategy,
        prelude_layers=prelude,
        coda_layers=coda,
        per_depth_vectors=norms == "per-depth",
        **relax,
    )
    config.lora_ranks, capped = _resolve_ranks(config, lora_ranks)
    config.conversion = {
        **src_cfg.conversion,
        "loops": loops,
        "strategy": strategy,
        "prelude": config.prelude_layers,
        "coda": config.coda_layers,
        "init": init,
        "norms": norms,
        "lora_ranks": dict(config.lora_ranks),
        "lora_init": lora_init if config.is_relaxed else None,
        "prefix_length": relax["prefix_length"],
        **{k: True for k in ("loop_scale", "magnitude") if relax[k]},  # recorded where used
    }
    if capped:
        config.conversion["capped_ranks"] = capped
    return config


def _init_layers(vanilla, model, init: str, norms: str, lora_init: str, calibration) -> None:
    """Unique blocks copied from their pretrained layer; the shared weights, biases, norms and LoRAs of every
    shared block from the pretrained layers tied to it."""
    from . import aware

    config = model.config
    plan = config.plan
    chosen = selected_layers(config, init)
    src_layers = vanilla.model.layers
    for k, depths in enumerate(tied_depths(config)):
        block = model.model.layers[k]
        if plan.is_unique(k):
            _copy_layer(src_layers[depths[0]], block)
            continue
        pick = chosen[plan.shared_blocks.index(k)] if chosen else depths[0]  # the "one layer" for Norm-choice
        src_lin = [_linears(src_layers[d]) for d in depths]
        for name, lin in _linears(block).items():
            stack = torch.stack([s[name].weight for s in src_lin])
            problem = (
                aware.depth_problem(calibration, stack, depths, name.rsplit(".", 1)[-1], norms, pick)
                if calibration is not None and (init == "aware" or lora_init == "aware-svd")
                else None
            )
            if init == "aware":
                lin.weight.copy_(aware.shared_weight(*problem))
            elif init == "average":
                lin.weight.copy_(stack.mean(0))
            elif chosen:
                lin.weight.copy_(_linears(src_layers[pick])[name].weight)
            if lin.bias is not None:
                biases = torch.cat([s[name].bias for s in src_lin])  # [B, out]
                if config.per_depth_vectors:
                    lin.bias.copy_(biases)
                elif init in ("average", "aware"):
                    lin.bias.copy_(biases.mean(0, keepdim=True))
                elif chosen:
                    lin.bias.copy_(_linears(src_layers[pick])[name].bias)
            if lin.rank:
                _init_lora(lin, stack, lora_init, problem)
        src_norm = [_norms(src_layers[d]) for d in depths]
        for name, norm in _norms(block).items():
            for param in ("weight", "bias"):
                dst = getattr(norm, param)
                if dst is None:
                    continue
                vectors = torch.cat([getattr(s[name], param) for s in src_norm])  # [B, dim]
                if norms == "per-depth":
                    dst.copy_(vectors)
                elif norms == "tied-avg":
                    dst.copy_(vectors.mean(0, keepdim=True))
                elif norms == "tied-choice":
                    dst.copy_(getattr(_norms(src_layers[pick])[name], param))
                else:  # tied-zero, the paper's Norm-zero
                    dst.zero_()


def _copy_layer(src, dst) -> None:
    """A pretrained layer into a unique block of one slot: the same parameters, exactly."""
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    if unexpected or any(not key.endswith("attn.prefix") for key in missing):  # a prefix is the relaxation's own
        raise ConfigError(f"a unique layer does not match its pretrained one: missing {missing}, extra {unexpected}")


def _copy_outer(vanilla: LoopLMForCausalLM, model: LoopLMForCausalLM) -> None:
    """Embeddings, final norm and (untied) LM head: the parts outside the looped layers."""
    model.model.embed_tokens.weight.copy_(vanilla.model.embed_tokens.weight)
    model.model.norm.weight.copy_(vanilla.model.norm.weight)
    if model.model.norm.bias is not None:
        model.model.norm.bias.copy_(vanilla.model.norm.bias)
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.copy_(vanilla.lm_head.weight)


def _init_lora(lin: LoopLinear, pretrained: torch.Tensor, how: str, problem=None) -> None:
    """Per-depth LoRA init. SVD: B_d A_d = best rank-r approximation of W_d - W'. A depth whose
    pretrained weight equals the shared one (nothing to approximate) gets the ordinary zero init,
    A Gaussian and B zero, as does every depth under zero init (paper appendix C)."""
    if how == "aware-svd":  # targets and input statistics from aware.depth_problem
        from .aware import whitened_svd_factors

        pretrained, covs = problem
    for slot, w_d in enumerate(pretrained):
        residual = w_d - lin.weight.to(w_d.dtype)
        if how == "zero" or not residual.any():
            lin.lora_A[slot].normal_(std=lin.in_features**-0.5)
            lin.lora_B[slot].zero_()
            continue
        b, a = (
            whitened_svd_factors(residual, covs[slot], lin.rank)
            if how == "aware-svd"
            else svd_factors(residual, lin.rank)
        )
        lin.lora_B[slot].copy_(b)
        lin.lora_A[slot].copy_(a)


@torch.no_grad()
def unroll(model: LoopLMForCausalLM) -> LoopLMForCausalLM:
    """The equivalent vanilla (B = 1) model: every depth gets dense weights W' + B_d A_d, its own
    norm weights and its own prefix. Used for export and to check that conversion is exact where it should
    be. An exit adapter is dropped: the unrolled model has no intermediate loop to exit after."""
    c = model.config
    if c.loop_scale:
        raise ConfigError(
            "a model with a loop scale has no vanilla equivalent (the scale multiplies the residual stream between "
            "loops, which no dense layer can do); unroll or export a model converted without --loop-scale"
        )
    config = _derived_config(
        c,
        num_loops=1,
        sharing="cycle",
        prelude_layers=0,
        coda_layers=0,
        per_depth_vectors=False,
        lora_ranks={},
        magnitude=False,  # merged_weight scales each depth's rows by it
        exit_adapter=None,
    )
    out = LoopLMForCausalLM(config).to(next(model.parameters()).dtype)
    out.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith(("model.layers.", "exit_adapter."))},
        strict=False,
    )
    for d, (k, slot) in enumerate(zip(c.layer_map, c.slot_map)):
        shared, dense = model.model.layers[k], out.model.layers[d]
        dense_lin = _linears(dense)
        for name, lin in _linears(shared).items():
            dense_lin[name].weight.copy_(lin.merged_weight(slot))
            if lin.bias is not None:
                dense_lin[name].bias.copy_(lin.bias[slot if lin.bias.shape[0] > 1 else 0][None])
        dense_norm = _norms(dense)
        for name, norm in _norms(shared).items():
            row = slot if norm.weight.shape[0] > 1 else 0
            dense_norm[name].weight.copy_(norm.weight[row][None])
            if norm.bias is not None:
                dense_norm[name].bias.copy_(norm.bias[row][None])
        if shared.attn.prefix is not None:
            dense.attn.prefix.copy_(shared.attn.prefix[slot][None])
    if out.config.tie_word_embeddings:
        out.tie_weights()
    return out.eval()


def count_parameters(model: LoopLMForCausalLM) -> dict:
    """Total, embedding and N-emb (everything but the embedding matrix and LM head, LoRAs and prefixes
    included, as the paper counts), plus the LoRA and prefix shares of N-emb and the exit adapter's size.
    The exit adapter (models/exit_adapter.py) counts in the total only, not in N-emb: it serves intermediate
    exits at the head, and the paper's appendix-I table gives its frozen-body head-LoRA row the base model's
    N-emb."""
    from ..models.quantized import QuantWeight

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    # a quantized model (looplm quantize) holds its weights as buffers: count each [out, in] weight once
    total += sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantWeight))
    c = model.config
    emb = c.vocab_size * c.hidden_size
    if not c.tie_word_embeddings:
        emb += c.vocab_size * c.hidden_size
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    adapter = sum(p.numel() for p in model.exit_adapter.parameters()) if model.exit_adapter is not None else 0
    prefix = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".attn.prefix"))
    return {
        "total": total,
        "embedding": emb,
        "n_emb": total - emb - adapter,
        "lora": lora,
        "prefix": prefix,
        "exit_adapter": adapter,
    }


def describe(model: LoopLMForCausalLM) -> dict:
    """Everything `looplm info` prints: counts, structure and the layer map."""
    c = model.config
    return {
        "family": c.family,
        "depth": c.num_hidden_layers,
        "loops": c.num_loops,
        "shared_layers": c.num_shared_layers,
        "sharing": c.sharing,
        "plan": c.plan.describe(),
        "unique_layers": sum(c.plan.is_unique(b) for b in range(c.num_blocks)),
        "per_depth_vectors": c.per_depth_vectors,
        "lora_ranks": c.lora_ranks,
        "exit_adapter_spec": copy.deepcopy(c.exit_adapter),
        "prefix_length": c.prefix_length,
        "loop_scale": c.loop_scale,
        "magnitude": c.magnitude,
        "quantization": {k: v for k, v in (getattr(c, "quantization", None) or {}).items() if k != "sha256"} or None,
        "layer_map": c.layer_map,
        "depth_attention": c.depth_attention,
        "conversion": copy.deepcopy(c.conversion),
        **count_parameters(model),
    }
