"""The vanilla looplm decoder reproduces transformers' own implementation of every family."""

import pytest
import torch
from conftest import FAMILIES, make_hf_model

from looplm.models import ConfigError, LoopLMConfig, LoopLMForCausalLM, from_hf_model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    hf = make_hf_model(family)
    ours = from_hf_model(hf)
    ids = torch.randint(0, 128, (2, 24))  # longer than Gemma's test window (8): sliding masks bind
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert diff < 1e-4, f"{family}: max |logit diff| {diff}"


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3", "gpt_neox"])
def test_padded_batch_matches_transformers(family):
    hf = make_hf_model(family)
    ours = from_hf_model(hf)
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding on the second row
    with torch.no_grad():
        a = hf(ids, attention_mask=mask).logits
        b = ours(ids, attention_mask=mask).logits
    assert (a[mask.bool()] - b[mask.bool()]).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt_neox"])
def test_generate_matches_transformers(family):
    """Greedy generate with the KV cache (transformers' GenerationMixin on our model)."""
    hf = make_hf_model(family)
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
