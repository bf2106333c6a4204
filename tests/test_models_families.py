"""The vanilla looplm decoder reproduces transformers' own implementation of every family.

The families added after the first four (``NEW_FAMILIES``) are built here at a scale where a mistake
shows: weights drawn with std 0.2 (transformers' default 0.02 gives logits of about N(0, 0.16) and nearly
uniform attention), sequences past every sliding window, windows on, rope scaling that binds within the
sequence. tests/test_models_families_features.py switches each feature off and checks that it matters.
"""

import pytest
import torch
from conftest import FAMILIES, SMALL, make_hf_model, visible_norms_and_biases

from looplm.models import ConfigError, LoopLMConfig, LoopLMForCausalLM, from_hf_model

# Every family's weights at the scale above; norms and biases perturbed as conftest's make_hf_model does.
INIT = 0.2
WINDOW = 8  # shorter than the test sequences (20-24 tokens): sliding masks bind
LLAMA3_ROPE = {  # Llama 3.2's rope with the original context shrunk so that scaling binds at 24 tokens
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _new_family_config(family: str, num_layers: int):
    """A transformers config of ``family`` with every feature that family has switched on."""
    import transformers as T

    small = {**SMALL, "num_hidden_layers": num_layers, "initializer_range": INIT}
    half = num_layers // 2
    if family == "mistral":
        return T.MistralForCausalLM, T.MistralConfig(**small, sliding_window=WINDOW, tie_word_embeddings=False)
    if family == "llama3":  # Llama 3.2 shapes: tied head, 4:1 grouped-query attention, llama3 rope
        cfg = {**small, "num_key_value_heads": 1}
        return T.LlamaForCausalLM, T.LlamaConfig(**cfg, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)
    if family == "llama-linear-rope":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
        return T.LlamaForCausalLM, T.LlamaConfig(**small, rope_parameters=rope, tie_word_embeddings=False)
    if family in ("qwen2", "qwen2-tied"):
        window = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=half)
        return T.Qwen2ForCausalLM, T.Qwen2Config(**small, **window, tie_word_embeddings=family == "qwen2-tied")
    if family == "qwen3":
        window = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=half)
        return T.Qwen3ForCausalLM, T.Qwen3Config(**small, **window, attention_bias=True, tie_word_embeddings=False)
    if family == "phi3":  # a sliding window as Phi-3-mini-4k has; partial rotary as Phi-4-mini has
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
        return T.Phi3ForCausalLM, T.Phi3Config(**small, sliding_window=WINDOW, rope_parameters=rope, pad_token_id=0)
    if family == "olmo2":
        return T.Olmo2ForCausalLM, T.Olmo2Config(**small, pad_token_id=0)
    if family == "olmo3":
        layer_types = ["sliding_attention", "full_attention"] * half
        return T.Olmo3ForCausalLM, T.Olmo3Config(
            **small, sliding_window=WINDOW, layer_types=layer_types, pad_token_id=0
        )
    if family == "smollm3":  # SmolLM3's NoPE every 4th layer: looped, a shared layer rotates at one depth only
        window = dict(use_sliding_window=True, sliding_window=WINDOW)  # SmolLM3 slides only its NoPE layers
        no_rope = [int((i + 1) % 4 != 0) for i in range(num_layers)]
        return T.SmolLM3ForCausalLM, T.SmolLM3Config(**small, no_rope_layers=no_rope, **window, pad_token_id=0)
    raise ValueError(family)


def make_family_model(family: str, num_layers: int = 4, seed: int = 0):
    """A random transformers model of any family in ALL_FAMILIES (the first four through conftest)."""
    if family in FAMILIES:
        return make_hf_model(family, num_layers, seed)
    torch.manual_seed(seed)
    cls, config = _new_family_config(family, num_layers)
    model = cls(config)
    return visible_norms_and_biases(model)


NEW_FAMILIES = ["mistral", "llama3", "qwen2", "qwen2-tied", "qwen3", "phi3", "olmo2", "olmo3", "smollm3"]
ALL_FAMILIES = FAMILIES + NEW_FAMILIES
TOLERANCE = 1e-5  # float32


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_logits_match_transformers(family):
    hf = make_family_model(family)
    ours = from_hf_model(hf)
    ids = torch.randint(0, 128, (2, 24))  # longer than the test windows (8): sliding masks bind
    with torch.no_grad():
        diff = max_diff(hf(ids).logits, ours(ids).logits)
    assert diff < TOLERANCE, f"{family}: max |logit diff| {diff}"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_padded_batch_matches_transformers(family):
    hf = make_family_model(family)
    ours = from_hf_model(hf)
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding on the second row
    with torch.no_grad():
        a = hf(ids, attention_mask=mask).logits
        b = ours(ids, attention_mask=mask).logits
    assert max_diff(a[mask.bool()], b[mask.bool()]) < TOLERANCE


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"] + NEW_FAMILIES)
def test_generate_matches_transformers(family):
    """Greedy generate with the KV cache (transformers' GenerationMixin on our model), past the windows."""
    hf = make_family_model(family)
    ours = from_hf_model(hf)
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        a = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        b = ours.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_cached_decoding_equals_full_forward():
    hf = make_hf_model("gemma3")
    model = from_hf_model(hf)
    ids = torch.randint(0, 128, (1, 16))  # past the window of 8
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :10], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(10, 16):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-4


def test_static_exit_runs_fewer_loops():
    config = LoopLMConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_loops=2
    )
    model = LoopLMForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        h, states, _ = model.model(ids, output_loop_states=True)
        assert len(states) == 2 and torch.equal(states[-1], h)
        exit1 = model(ids, num_loops=1).logits
    assert torch.allclose(exit1, model.exit_logits(states[0]))
    with pytest.raises(ConfigError, match="out of range"):
        model(ids, num_loops=3)


def test_lm_head_on_few_rows_equals_the_module():
    """exit_logits computes a few rows' head as (W x^T)^T on CPU: the same logits as nn.Linear, and a
    hooked head (a user's adapter, a profiler) still runs as a module."""
    config = LoopLMConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LoopLMForCausalLM(config).eval()
    for shape in [(1, 32), (6, 32), (2, 3, 32), (70, 32)]:
        x = torch.randn(shape)
        torch.testing.assert_close(model._lm_head(x), model.lm_head(x), rtol=1e-5, atol=1e-6)
    calls = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    model._lm_head(torch.randn(4, 32))
    handle.remove()
    assert calls == [torch.Size([4, 300])]


def test_unknown_family_is_a_clear_error():
    import transformers as T

    from looplm.models import config_from_hf

    with pytest.raises(ConfigError, match="not supported"):
        config_from_hf(T.GPT2Config())
