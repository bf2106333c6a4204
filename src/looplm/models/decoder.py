"""The looped decoder: a prelude of unique layers, K shared blocks looped B times, a coda of unique layers.

``LoopLMModel.forward`` is the whole method in one loop over the plan's path (models/plan.py): depth d runs
block s(d) with the per-depth parameters of slot(d), attention kind (full or sliding) of depth d, and KV cache
entry d. With B = 1 and no LoRA it is exactly the pretrained decoder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .config import ConfigError, LoopLMConfig
from .exit_adapter import ExitAdapter
from .layers import Attention, Block, DepthNorm, LoopLinear, Rotary


def attention_masks(
    kinds, batch: int, q_len: int, past_len: int, attention_mask: torch.Tensor | None, window: int | None, device
) -> dict:
    """Boolean masks [b|1, 1, q, kv] (True = may attend) per attention kind, or None where plain
    causal attention (SDPA's is_causal, or no mask for one query) is exact."""
    kv_len = past_len + q_len
    masks = {}
    for kind in kinds:
        window_binds = kind == "sliding" and window is not None and kv_len > window
        if attention_mask is None and not window_binds and (past_len == 0 or q_len == 1):
            masks[kind] = None
            continue
        q_idx = torch.arange(past_len, kv_len, device=device)[:, None]
        k_idx = torch.arange(kv_len, device=device)[None, :]
        m = k_idx <= q_idx
        if window_binds:
            m = m & (q_idx - k_idx < window)
        m = m[None, None]
        if attention_mask is not None:
            # A padded query would see nothing (NaN in softmax); letting it see itself is harmless.
            m = (m & attention_mask[:, None, None, -kv_len:].bool()) | (k_idx == q_idx)
        masks[kind] = m
    return masks


class PeekCache:
    """A cache read and never written: ``update`` gives a depth's cached keys and values followed by this call's,
    as a cache would, and stores nothing. An intermediate exit's coda attends to the earlier
    positions through it and leaves the cache as the path taken writes it."""

    def __init__(self, cache):
        self.cache = cache

    def update(self, k: torch.Tensor, v: torch.Tensor, depth: int, *args):
        layers = self.cache.layers
        if depth >= len(layers) or getattr(layers[depth], "keys", None) is None or not layers[depth].keys.numel():
            return k, v
        return torch.cat([layers[depth].keys, k], dim=-2), torch.cat([layers[depth].values, v], dim=-2)


class LoopLMPreTrainedModel(PreTrainedModel):
    config_class = LoopLMConfig
    config: LoopLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, LoopLinear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            if module.lora_A is not None:
                nn.init.normal_(module.lora_A, std=module.in_features**-0.5)
                nn.init.zeros_(module.lora_B)
            if module.magnitude is not None:
                nn.init.ones_(module.magnitude)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, Rotary):
            module.reset()
        elif isinstance(module, Attention) and module.prefix is not None:
            nn.init.normal_(module.prefix, std=std)  # small random; the paper does not say
        elif isinstance(module, DepthNorm):
            (nn.init.zeros_ if module.kind == "rms_plus1" else nn.init.ones_)(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, ExitAdapter):
            module.reset_parameters()


class LoopLMModel(LoopLMPreTrainedModel):
    def __init__(self, config: LoopLMConfig):
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, k) for k in range(c.num_blocks))
        self.norm = DepthNorm(c.hidden_size, c.norm_type, c.norm_eps)
        self.rotary = Rotary(c)
        self.gradient_checkpointing = False
        self.post_init()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:
            h = h * torch.tensor(self.config.embedding_multiplier, dtype=h.dtype)
        return h

    def check_loops(self, num_loops: int | None) -> int:
        B = self.config.num_loops
        if num_loops is None:
            return B
        if not 1 <= num_loops <= B:
            raise ConfigError(f"exit loop {num_loops} is out of range: this model has {B} loops (use 1..{B})")
        return num_loops

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        num_loops: int | None = None,
        output_loop_states: bool = False,
        output_depth_states: bool = False,
        **kwargs,
    ):
        """Returns (hidden after the last depth run, [hidden after each loop's exit] or None, cache).

        num_loops < B is a static exit: every token leaves after that many loops of the core, then runs the coda.
        The state after loop i's exit is the core's state after loop i through the coda, which reads the cache
        (the earlier positions' keys and values) but never writes it: only the path taken writes it. With
        ``output_depth_states`` the second item holds the hidden state after every depth of the path instead
        (healing matches each one against the original model's)."""
        c = self.config
        plan = c.plan
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = h.shape[:2]
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + t, device=h.device)[None].expand(b, t)
        tables = self.rotary(position_ids, h.dtype)
        masks = attention_masks(set(c.depth_attention), b, t, past_len, attention_mask, c.sliding_window_size, h.device)
        loops = self.check_loops(num_loops)

        def run(h, depths, cache):
            return self._run(h, depths, tables, masks, cache, output_depth_states)

        h, depth_states = run(h, plan.prelude, past_key_values)
        loop_states = [] if output_loop_states else None
        for i in range(loops if plan.looped else 1):
            h, states = run(h, plan.loop(i), past_key_values)
            depth_states += states
            if loop_states is not None and i < loops - 1:
                peek = None if past_key_values is None else PeekCache(past_key_values)
                loop_states.append(run(h, plan.coda, peek)[0] if plan.coda else h)
        h, states = run(h, plan.coda, past_key_values)
        depth_states += states
        if loop_states is not None:
            loop_states.append(h)
        return h, depth_states if output_depth_states else loop_states, past_key_values

    def _run(self, h, depths, tables, masks, cache, collect: bool):
        """``depths`` (models/plan.py ``Depth``s) in order from state ``h``: the last state and, with ``collect``,
        the state after each."""
        states = []
        for dep in depths:
            cos, sin = tables[dep.kind]
            layer, args = self.layers[dep.block], (dep.slot, cos, sin, masks[dep.kind], cache, dep.index)
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, *args, use_reentrant=False)
            else:
                h = layer(h, *args)
            if collect:
                states.append(h)
        return h, states

    def run_depths(self, h: torch.Tensor, depths) -> torch.Tensor:
        """``depths`` alone on whole sequences ``h`` [rows, seq, hidden] from position 0, without a cache: one
        depth in healing's layer-local stage, or a plan's coda on an intermediate loop's state (an exit)."""
        c = self.config
        rows, seq = h.shape[:2]
        pos = torch.arange(seq, device=h.device)[None].expand(rows, -1)
        tables = self.rotary(pos, h.dtype)
        masks = attention_masks(set(c.depth_attention), rows, seq, 0, None, c.sliding_window_size, h.device)
        return self._run(h, depths, tables, masks, None, False)[0]

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None):
        self.gradient_checkpointing = enable


class LoopLMForCausalLM(LoopLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    head_cpu_weight = None  # how a serving engine multiplies the head on CPU (models/cpu_products.py)

    def __init__(self, config: LoopLMConfig):
        super().__init__(config)
        self.model = LoopLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Only the exits after intermediate loops use it (models/exit_adapter.py); the final output never does.
        self.exit_adapter = (
            ExitAdapter(config.exit_adapter, config.num_loops, config.hidden_size, config.vocab_size)
            if config.exit_adapter
            else None
        )
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def _lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T. For a few rows on CPU (decode steps, exit decisions) a serving engine's measured choice for this
        CPU (models/cpu_products.py) runs it; without one, (W x^T)^T, the same product (see that module). Elsewhere
        (GPU, long sequences, a wrapped or hooked head) the module itself runs."""
        head = self.lm_head
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if (
            x.device.type != "cpu"
            or not 0 < rows <= 64
            or type(head) is not nn.Linear
            or head.bias is not None
            or head._forward_hooks
            or head._forward_pre_hooks
        ):
            return head(x)
        if self.head_cpu_weight is not None and self.head_cpu_weight.usable(x, head.weight):
            return self.head_cpu_weight.linear(x)
        return (head.weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous().reshape(*x.shape[:-1], -1)

    def exit_states(self, h: torch.Tensor, loop: int | torch.Tensor | None = None) -> torch.Tensor:
        """What the LM head reads at an exit (``exit_logits``' loop argument): the exit adapter's change of
        the hidden state, if it has one, then the final norm."""
        if isinstance(loop, int) and not 0 <= loop < self.config.num_loops:
            raise ConfigError(f"exit after loop index {loop}: this model has loops 0..{self.config.num_loops - 1}")
        if loop is not None and self.exit_adapter is not None:
            h = self.exit_adapter.adapt_hidden(h, loop)
        return self.model.norm(h)

    def exit_logits_are_head(self, loop: int | None = None) -> bool:
        """Whether an exit's logits are the plain LM head (and soft-cap) of ``exit_states``: no adapter
        acts on the logits themselves (losses can then fuse the head, train/losses.py head_kd_loss)."""
        return loop is None or self.exit_adapter is None or self.exit_adapter.kind != "head-lora"

    def exit_logits(self, h: torch.Tensor, loop: int | torch.Tensor | None = None) -> torch.Tensor:
        """The exit after any loop: final norm, LM head, and Gemma 2's logit soft-cap. ``loop`` is the 0-based
        loop ``h`` comes from (an int, or a LongTensor with one loop per row of ``h`` when a batch mixes
        loops); the model's exit adapter, if any, applies to the loops before the last. None or the last
        loop: the plain exit, the model's normal output."""
        z = self.exit_states(h, loop)
        logits = self._lm_head(z)
        if loop is not None and self.exit_adapter is not None:
            logits = self.exit_adapter.adapt_logits(logits, z, loop)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def exit_losses(self, input_ids, attention_mask=None, num_loops: int | None = None, final_only: bool = False):
        """Every loop exit's next-token loss on windows ``input_ids`` [rows, seq]: the one per-loop scorer behind
        `looplm eval`'s perplexity and the held-out evaluations of training and healing. Returns each exit's
        summed negative log-likelihood per window [loops, rows] (float64, on the host), each exit's count of
        scored tokens whose top token is the final exit's [loops], and each window's scored tokens [rows].
        Targets at masked (padding) positions are not scored; ``final_only``: the last exit alone (the rows of
        the others stay 0)."""
        loops = self.model.check_loops(num_loops)
        mask = attention_mask if attention_mask is not None and not bool(attention_mask.all()) else None
        _, states, _ = self.model(input_ids, mask, num_loops=loops, output_loop_states=True)
        targets = input_ids[:, 1:]
        if mask is not None:
            targets = targets.masked_fill(mask[:, 1:] == 0, -100)
        nll = torch.zeros(loops, len(input_ids), dtype=torch.float64)
        agree = torch.zeros(loops, dtype=torch.float64)
        for row in range(len(input_ids)):
            final = None
            # one window at a time: a [rows, seq, vocab] float32 block is GBs for Gemma's 262k vocabulary
            for i in reversed(range(loops - 1 if final_only else 0, loops)):
                logits = self.exit_logits(states[i][row, :-1], loop=i).float()
                nll[i, row] = F.cross_entropy(logits, targets[row], ignore_index=-100, reduction="sum").double().cpu()
                top = logits.argmax(-1)
                final = top if final is None else final
                agree[i] += float(((top == final) & (targets[row] != -100)).sum())
        return nll, agree, (targets != -100).sum(1).cpu()

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep: int = 0,
        num_loops: int | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        h, _, cache = self.model(
            input_ids,
            attention_mask,
            position_ids,
            past_key_values if use_cache or past_key_values is not None else None,
            inputs_embeds,
            num_loops=num_loops,
        )
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.exit_logits(h, None if num_loops is None else num_loops - 1)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
