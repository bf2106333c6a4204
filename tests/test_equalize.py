"""Input-channel equalisation before rounding (models/equalize.py): the model computes the same function, the
moments it returns are the scaled model's own, the search never raises a group's output error, and on inputs
with outlier channels the rounded model moves less."""

import copy

import pytest
import torch
from conftest import TINY as CONFTEST_TINY
from conftest import quantize_args
from test_gptq import FORMATS
from test_train_fixtures import build_corpus, make_models

from looplm.commands import main
from looplm.models import LoopLMConfig, LoopLMForCausalLM, load_model
from looplm.models import equalize as EQ
from looplm.models import gptq as G
from looplm.models import quantized as Q

TINY = dict(
    CONFTEST_TINY,
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_loops=2,
    per_depth_vectors=True,
    lora_ranks={"q": 2, "kv": 2, "out": 2, "ffn": 2},
)
FAMILIES = {
    "llama": dict(prefix_length=2, attention_bias=True, mlp_bias=True),
    "gemma": dict(
        family="gemma3",
        norm_type="rms_plus1",
        sandwich_norms=True,
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        rope={"full": {"theta": 1e4, "type": "default"}},
    ),
    "neox": dict(
        family="gpt_neox",
        norm_type="layer",
        parallel_residual=True,
        mlp_type="plain",
        hidden_act="gelu",
        attention_bias=True,
        mlp_bias=True,
    ),
}


def outlier_model(family: str) -> LoopLMForCausalLM:
    """A looped, relaxed model whose inputs and weights have outlier channels, as trained LLMs' do."""
    torch.manual_seed(0)
    model = LoopLMForCausalLM(LoopLMConfig(**TINY, **FAMILIES[family])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "bias" in name or name.endswith(".attn.prefix"):
                p.normal_(std=0.1)
            elif "norm" in name and p.dim() == 2:
                p.add_(0.1 * torch.randn_like(p))
                p[:, :3] += 4.0  # three large input channels into every linear after a norm
        for block in model.model.layers:
            for lin in (block.attn.q_proj, block.mlp.down_proj, block.attn.o_proj):
                lin.weight[:, -2:] *= 6  # columns of large weights
    return model


def rows(n=4, t=24):
    return torch.randint(0, TINY["vocab_size"], (n, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_equalizing_keeps_the_function_and_returns_the_scaled_inputs_moments(family, fmt):
    model, ids = outlier_model(family), rows()
    moments = G.input_moments(model, ids)
    with torch.no_grad():
        before = model(ids).logits
    scaled, groups = EQ.equalize(model, moments, fmt)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * before.abs().max().item())
    assert all(g["error"] <= g["error_before"] for g in groups)
    assert sum(g["alpha"] + g["beta"] > 0 for g in groups) >= len(groups) // 2  # the outliers are worth scaling
    kinds = {g["linears"][0].rsplit(".", 1)[1] for g in groups}
    assert kinds == (
        {"q_proj", "up_proj", "o_proj"} if family == "neox" else {"q_proj", "gate_proj", "down_proj", "o_proj"}
    )
    again = G.input_moments(model, ids)  # what the scaled model's linears read
    for name, per_slot in again.items():
        for slot, h in per_slot.items() if name != "lm_head" else ():
            want = scaled[name][slot]
            assert torch.allclose(h, want, rtol=1e-3, atol=1e-4 * want.abs().max().item()), name


@pytest.mark.skipif("int8" not in FORMATS, reason="this torch build does not run the int8 op on CPU")
@pytest.mark.parametrize("rounding", ["nearest", "gptq"])
def test_an_equalized_int8_model_moves_less_on_outlier_channels(rounding):
    model, ids = outlier_model("llama"), rows()
    moments = G.input_moments(model, ids)
    layers_only = {k: v for k, v in moments.items() if k != "lm_head"}  # as test_gptq: the toy's tied head aside
    with torch.no_grad():
        ref = model(ids).logits
        plain = Q.quantize_model(
            copy.deepcopy(model), "int8", act_dtype=torch.float32, moments=layers_only if rounding == "gptq" else None
        )
        eq = copy.deepcopy(model)
        scaled, _ = EQ.equalize(eq, layers_only, "int8")
        eq = Q.quantize_model(eq, "int8", act_dtype=torch.float32, moments=scaled if rounding == "gptq" else None)
        assert (eq(ids).logits - ref).norm() < 0.8 * (plain(ids).logits - ref).norm()


def test_the_value_scales_are_shared_by_the_query_heads_of_a_kv_head():
    tie = EQ._tie_heads(num_heads=4, num_kv_heads=2, head_dim=3)
    s = tie(torch.arange(1, 13, dtype=torch.float32))
    assert torch.equal(s.view(2, 2, 3)[:, 0], s.view(2, 2, 3)[:, 1])
    assert torch.allclose(s[:3], (torch.tensor([1.0, 2, 3]) * torch.tensor([4.0, 5, 6])).sqrt())


@pytest.mark.skipif("int8" not in FORMATS, reason="this torch build does not run the int8 op on CPU")
def test_quantize_equalize_command(tmp_path, capsys):
    models = make_models(tmp_path)
    corpus = build_corpus(tmp_path, models["student"], seq_len=32)
    fmt, out = "int8", tmp_path / "q"
    assert main(quantize_args(models["student"], out, "--weights", fmt, "--calib-data", corpus, "--calib-rows", 4)) == 0
    assert "input channels equalized" in capsys.readouterr().out  # the default with --calib-data
    back = load_model(out)[0]
    rec = back.config.quantization
    assert rec["rounding"] == "gptq" and rec["calibration"]["equalized"]["groups"] == 2 * 4  # 2 layers x 4 groups
    ids = rows(2, 16) % 256
    with torch.no_grad():  # the stored norms and rows carry the scales: the quantized model is the float one, rounded
        want, got = load_model(models["student"])[0](ids).logits, back(ids).logits
    assert (got - want).norm() < 0.03 * want.norm()  # 0.013 here; 0.058 if the norms kept their scales
    assert main(quantize_args(models["student"], tmp_path / "bad", "--equalize")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--calib-data" in err and not (tmp_path / "bad").exists()
