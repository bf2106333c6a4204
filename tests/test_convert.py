"""Conversion to Recursive and Relaxed Recursive Transformers (paper sections 2.2-2.3)."""

import pytest
import torch
from conftest import FAMILIES, make_hf_model

from looplm.convert import convert, count_parameters, parse_lora_ranks, stepwise_layers, svd_factors, unroll
from looplm.models import ConfigError, DepthPlan, from_hf_model


def layer_map(num_layers, num_loops, sharing="cycle"):
    return DepthPlan(num_layers, num_loops, sharing).layer_map


def slot_map(num_layers, num_loops, sharing="cycle"):
    return DepthPlan(num_layers, num_loops, sharing).slot_map


def test_layer_maps():
    assert layer_map(6, 2, "cycle") == [0, 1, 2, 0, 1, 2]
    assert layer_map(6, 2, "sequence") == [0, 0, 1, 1, 2, 2]
    assert layer_map(6, 2, "cycle-rev") == [0, 1, 2, 2, 1, 0]
    # B >= 3: cycle up to L - K, then only the last block reversed (Takase & Kasai, paper appendix B)
    assert layer_map(6, 3, "cycle-rev") == [0, 1, 0, 1, 1, 0]
    assert layer_map(9, 3, "cycle-rev") == [0, 1, 2, 0, 1, 2, 2, 1, 0]
    assert slot_map(6, 2, "cycle") == [0, 0, 0, 1, 1, 1]
    assert slot_map(6, 2, "sequence") == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ConfigError, match="does not divide"):
        layer_map(30, 7)


def test_stepwise_selection():
    assert stepwise_layers(6, 3, fixed_ends=True) == [0, 2, 5]  # round(2.5) = 2 (banker's rounding)
    assert stepwise_layers(30, 15, True)[0] == 0 and stepwise_layers(30, 15, True)[-1] == 29
    assert stepwise_layers(6, 3, fixed_ends=False) == [0, 2, 4]


@pytest.fixture(scope="module")
def vanilla():
    return from_hf_model(make_hf_model("llama", num_layers=4))


def _layer(model, k):
    return model.model.layers[k]


def test_average_init_is_the_mean_of_tied_layers(vanilla):
    rec = convert(vanilla, loops=2, init="average", lora_ranks=0)
    for k in range(2):
        expected = (_layer(vanilla, k).attn.q_proj.weight + _layer(vanilla, k + 2).attn.q_proj.weight) / 2
        assert torch.allclose(_layer(rec, k).attn.q_proj.weight, expected)
        norm = (_layer(vanilla, k).attn_norm.weight + _layer(vanilla, k + 2).attn_norm.weight) / 2
        assert torch.allclose(_layer(rec, k).attn_norm.weight, norm)


@pytest.mark.parametrize("init,sources", [("stepwise", [0, 3]), ("stepwise-start", [0, 2]), ("lower", [0, 1])])
def test_selecting_inits_copy_one_layer(vanilla, init, sources):
    rec = convert(vanilla, loops=2, init=init, norms="tied-choice", lora_ranks=0)
    for k, src in enumerate(sources):
        assert torch.equal(_layer(rec, k).mlp.down_proj.weight, _layer(vanilla, src).mlp.down_proj.weight)
        assert torch.equal(_layer(rec, k).mlp_norm.weight, _layer(vanilla, src).mlp_norm.weight)


@pytest.mark.parametrize("init,sources", [("stepwise", [0, 3]), ("stepwise-start", [0, 2]), ("lower", [0, 1])])
def test_selecting_inits_copy_the_norms_of_their_layer_by_default(vanilla, init, sources):
    """Shared layer k holds layer src's linears, so by default its norms are layer src's too, not an
    average over the tied depths (the paper selects layers)."""
    rec = convert(vanilla, loops=2, init=init, lora_ranks=0)
    assert rec.config.conversion["norms"] == "tied-choice"
    for k, src in enumerate(sources):
        assert torch.equal(_layer(rec, k).attn_norm.weight, _layer(vanilla, src).attn_norm.weight)
        assert torch.equal(_layer(rec, k).mlp_norm.weight, _layer(vanilla, src).mlp_norm.weight)
    assert convert(vanilla, loops=2, init="average", lora_ranks=0).config.conversion["norms"] == "tied-avg"


def test_norm_options(vanilla):
    zero = convert(vanilla, loops=2, norms="tied-zero", lora_ranks=0)
    assert not _layer(zero, 0).attn_norm.weight.any()
    per = convert(vanilla, loops=2, norms="per-depth", lora_ranks=0)
    w = _layer(per, 1).attn_norm.weight
    assert w.shape[0] == 2
    assert torch.equal(w[0], _layer(vanilla, 1).attn_norm.weight[0])
    assert torch.equal(w[1], _layer(vanilla, 3).attn_norm.weight[0])


@pytest.mark.parametrize("norms", [None, "per-depth"])
def test_random_init_uses_no_pretrained_weight(norms):
    """Appendix E: the Random baseline leverages no pretrained weight: layers, biases, norms, embeddings,
    final norm and head are all fresh."""
    vanilla = from_hf_model(make_hf_model("llama-untied"))  # untied head, attention biases
    rnd = convert(vanilla, loops=2, init="random", norms=norms, lora_ranks=4)
    fresh = {n: p for n, p in rnd.state_dict().items() if "lora_" not in n}
    pretrained = vanilla.state_dict()
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(fresh)
    for name, p in fresh.items():
        src = pretrained[name] if name in pretrained else None
        if src is not None and src.shape == p.shape:
            assert not torch.allclose(p, src), name
    biases = _layer(rnd, 0).attn.q_proj.bias
    assert not biases.any()  # fresh biases are zero, not the pretrained ones


def test_rank_zero_lora_is_exactly_the_recursive_model(vanilla):
    """A relaxed model whose LoRAs are zero-initialised (B = 0) computes the recursive model."""
    rec = convert(vanilla, loops=2, init="average", lora_ranks=0)
    relaxed = convert(vanilla, loops=2, init="average", lora_ranks=8, lora_init="zero")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(rec(ids).logits, relaxed(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["cycle", "sequence", "cycle-rev"])
def test_full_rank_per_depth_recovers_the_original(family, strategy):
    hf = make_hf_model(family)
    vanilla = from_hf_model(hf)
    relaxed = convert(
        vanilla, loops=2, strategy=strategy, init="average", norms="per-depth", lora_ranks="full", lora_init="svd"
    )
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (relaxed(ids).logits - ref).abs().max().item() < 1e-4
        assert (unroll(relaxed)(ids).logits - ref).abs().max().item() < 1e-4


def test_depth_properties_stay_with_the_depth():
    """Gemma 3's sliding/full attention belongs to the depth, not to the shared weights."""
    vanilla = from_hf_model(make_hf_model("gemma3", num_layers=6))
    rec = convert(vanilla, loops=3, lora_ranks=0)
    assert rec.config.depth_attention == vanilla.config.depth_attention
    assert rec.config.layer_map == [0, 1, 0, 1, 0, 1]


def test_svd_init_is_the_best_rank_r_approximation(vanilla):
    relaxed = convert(vanilla, loops=2, init="average", lora_ranks=4, lora_init="svd")
    lin, src = _layer(relaxed, 0).mlp.up_proj, _layer(vanilla, 2).mlp.up_proj.weight
    residual = src - lin.weight
    approx = lin.lora_B[1] @ lin.lora_A[1]
    S = torch.linalg.svdvals(residual.double())
    optimal_error = S[4:].norm()  # Eckart-Young: the best rank-4 error
    assert (residual.double() - approx.double()).norm() <= optimal_error * 1.01
    assert (lin.merged_weight(1) - src).norm() < residual.norm()


def test_randomised_svd_matches_exact_truncation():
    torch.manual_seed(0)
    m = torch.randn(300, 200) @ torch.diag(torch.logspace(0, -3, 200)) @ torch.randn(200, 200)
    b, a = svd_factors(m, 8)  # 8 * 4 < 200: the randomised path
    U, S, Vh = torch.linalg.svd(m.double())
    exact_err = (m.double() - (U[:, :8] * S[:8]) @ Vh[:8]).norm()
    assert (m.double() - (b @ a).double()).norm() <= exact_err * 1.01


def test_zero_init_where_the_shared_weight_is_pretrained(vanilla):
    """Stepwise copies layers 0 and 3; their depths' LoRAs get A Gaussian, B zero (appendix C)."""
    relaxed = convert(vanilla, loops=2, init="stepwise", lora_ranks=4, lora_init="svd")
    q0, q1 = _layer(relaxed, 0).attn.q_proj, _layer(relaxed, 1).attn.q_proj
    assert not q0.lora_B[0].any() and q0.lora_A[0].any()  # depth 0 = layer 0 itself
    assert q0.lora_B[1].any()  # depth 2 differs from layer 0
    assert q1.lora_B[0].any() and not q1.lora_B[1].any()  # shared layer 1 = pretrained layer 3 = depth 3


def test_parameter_counts(vanilla):
    before = count_parameters(vanilla)
    rec = count_parameters(convert(vanilla, loops=2, lora_ranks=0))
    c = vanilla.config
    norm = c.hidden_size
    layer = sum(p.numel() for p in vanilla.model.layers[0].parameters())
    assert before["n_emb"] == 4 * layer + norm
    assert rec["n_emb"] == 2 * layer + norm
    relaxed = count_parameters(convert(vanilla, loops=2, lora_ranks=8))
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_depth = 8 * (
        (c.hidden_size + q_out)
        + 2 * (c.hidden_size + kv_out)
        + (q_out + c.hidden_size)
        + 3 * (c.hidden_size + c.intermediate_size)
    )
    assert relaxed["lora"] == 4 * per_depth
    assert relaxed["n_emb"] == rec["n_emb"] + relaxed["lora"]


def test_ranks_above_a_linear_are_capped_with_a_note(vanilla):
    """kv projections are 32 wide: rank 40 gives them rank 32 (full), as the paper's N-emb counts imply."""
    capped = convert(vanilla, loops=2, lora_ranks=40)
    assert capped.config.lora_ranks == {"q": 40, "kv": 32, "out": 40, "ffn": 40}
    assert capped.config.conversion["capped_ranks"] == {"kv": [40, 32]}
    assert capped.model.layers[0].attn.k_proj.lora_A.shape[1] == 32
    assert "capped_ranks" not in convert(vanilla, loops=2, lora_ranks=8).config.conversion


def test_rank_validation(vanilla):
    with pytest.raises(ConfigError, match="unknown LoRA group"):
        parse_lora_ranks("attn=4", 0)
    ranks = parse_lora_ranks("q=8,kv=4,out=8,ffn=full", 0)
    relaxed = convert(vanilla, loops=2, lora_ranks=ranks)
    assert relaxed.config.lora_ranks == {"q": 8, "kv": 4, "out": 8, "ffn": 64}
    with pytest.raises(ConfigError, match="already recursive"):
        convert(relaxed, loops=2)


def test_merged_lora_path_equals_the_two_matmul_path():
    """Large batches run W + B_s A_s as one weight (fewer FLOPs); outputs and gradients must not change."""
    from looplm.models.layers import LoopLinear

    torch.manual_seed(0)
    lin = LoopLinear(16, 24, bias=True, num_slots=2, bias_slots=2, rank=4)
    for p in lin.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 40, 16)  # 80 tokens x (16 + 24) > 16 x 24: the merge pays
    assert lin._merge_pays(x) and not lin._merge_pays(x[:, :4])
    outs, grads = [], []
    for merge in (True, False):
        lin.merge_lora = merge
        lin.zero_grad()
        y = lin(x, 1)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in lin.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-4)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
