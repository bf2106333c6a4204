"""The magnitude relaxation (DoRA's per-depth magnitude vector): every shared linear's output scaled per depth,
y = m_s * (W + B_s A_s) x + b, ones at first. Checked by hand on one linear, against the unrolled dense model, through
the serving engine's mixed-depth steps, int8 weights with the LoRA shared and merged, saving and healing."""

import pytest
import torch
from conftest import TINY, full_depth_greedy, serve_arriving, tiny_model

from looplm.convert import convert, count_parameters, unroll
from looplm.models import load_checkpoint, save_checkpoint
from looplm.models.layers import LoopLinear
from looplm.models.quantized import prepare
from looplm.train.heal.steps import body_params


def _vanilla():
    return tiny_model(0, num_hidden_layers=6)


def _with_magnitude(lora_ranks=4, strategy="middle-cycle"):
    model = convert(_vanilla(), loops=2, strategy=strategy, lora_ranks=lora_ranks, magnitude=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("magnitude"):
                p.uniform_(0.5, 1.5)
            elif "lora_B" in name:
                p.normal_(std=0.05)
    return model


def _ids(n=2, length=9, seed=1):
    return torch.randint(0, TINY["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


def test_one_linear_by_hand():
    torch.manual_seed(0)
    lin = LoopLinear(8, 5, bias=True, num_slots=2, bias_slots=2, rank=3, magnitude=True)
    with torch.no_grad():
        for p in lin.parameters():
            p.normal_()
    x = torch.randn(4, 8)
    for s in (0, 1):
        want = lin.magnitude[s] * (x @ (lin.weight + lin.lora_B[s] @ lin.lora_A[s]).T) + lin.bias[s]
        assert torch.allclose(lin(x, s), want, atol=1e-5)
        assert torch.allclose(x @ lin.merged_weight(s).T + lin.bias[s], want, atol=1e-5)
    slots = torch.tensor([0, 1, 1, 0])  # a batch that mixes depths: each row its own
    got = lin(x[:, None], slots[:, None])[:, 0]
    assert torch.allclose(got, torch.stack([lin(x[i], int(slots[i])) for i in range(4)]), atol=1e-5)


def test_at_ones_nothing_changes_and_only_shared_blocks_carry_it():
    vanilla = _vanilla()
    plain = convert(vanilla, loops=2, strategy="middle-cycle", lora_ranks=4)
    scaled = convert(vanilla, loops=2, strategy="middle-cycle", lora_ranks=4, magnitude=True)
    with torch.no_grad():
        assert torch.equal(plain(_ids()).logits, scaled(_ids()).logits)
    plan = scaled.config.plan
    for b, block in enumerate(scaled.model.layers):
        has = [m.magnitude is not None for m in block.modules() if isinstance(m, LoopLinear)]
        assert all(has) if b in plan.shared_blocks else not any(has)
    outs = sum(m.out_features for m in scaled.model.layers[1].modules() if isinstance(m, LoopLinear))
    added = count_parameters(scaled)["n_emb"] - count_parameters(plain)["n_emb"]
    assert added == outs * sum(plan.block_slots[b] for b in plan.shared_blocks)


def test_the_unrolled_model_folds_it_into_each_depths_weight():
    model = _with_magnitude()
    dense = unroll(model)
    assert not dense.config.magnitude
    with torch.no_grad():
        assert torch.allclose(model(_ids()).logits, dense(_ids()).logits, atol=1e-4)


@pytest.mark.parametrize("scheduler", ["sequence", "depth"])
def test_the_engine_serves_it_exactly(scheduler):
    model = _with_magnitude(strategy="cycle")  # a cycle core: every step of the depth-wise run mixes loops
    prompts = [_ids(1, n, seed=10 + n)[0].tolist() for n in (5, 11, 3)]
    engine, outputs = serve_arriving(model, prompts, 6, scheduler)
    assert outputs == [full_depth_greedy(model, p, 6) for p in prompts]
    if scheduler == "depth":
        assert engine.stats["mixed_stages"] > 0


@pytest.mark.parametrize("lora", ["shared", "merged"])
def test_int8_weights_keep_it(lora):
    """Shared: the magnitude stays a float vector; merged: it is folded into each depth's rounded weight. Either
    way the int8 model follows the float one far more closely than the same weights rounded without it."""
    model = _with_magnitude()
    quantized = prepare(_with_magnitude(), "int8", lora=lora)
    without = _with_magnitude()
    with torch.no_grad():
        for name, p in without.named_parameters():
            if name.endswith("magnitude"):
                p.fill_(1.0)
    without = prepare(without, "int8", lora=lora)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits.flatten()
        err, err_without = ((m(ids).logits.flatten() - want).norm() / want.norm() for m in (quantized, without))
    assert err < 0.08 and err < err_without / 4  # 0.045 against 0.44 on the EPYC
    kept = [m.magnitude is not None for m in quantized.modules() if isinstance(m, LoopLinear)]
    assert any(kept) == (lora == "shared")


def test_saved_loaded_and_healed(tmp_path):
    model = _with_magnitude()
    save_checkpoint(model, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m")
    assert loaded.config.magnitude and loaded.config.conversion["magnitude"]
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, model(_ids()).logits)
    params = {id(p) for p in body_params(loaded, "fp32")}
    magnitudes = [p for n, p in loaded.named_parameters() if n.endswith("magnitude")]
    assert magnitudes and all(id(p) in params for p in magnitudes)
    loaded(_ids(), labels=_ids()).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in magnitudes)


@pytest.mark.parametrize("lora", ["shared", "merged"])
def test_looplm_quantize_stores_and_reloads_it(tmp_path, lora):
    """`looplm quantize`: the magnitude is saved as a float tensor (shared) or inside each depth's rounded weight
    (merged, no magnitude tensor), and the reloaded model serves what the in-memory quantized one does."""
    from conftest import quantize_args
    from safetensors import safe_open

    from looplm.commands import main

    save_checkpoint(_with_magnitude(), tmp_path / "m")
    out = tmp_path / f"q-{lora}"
    assert main(quantize_args(tmp_path / "m", out, "--weights", "int8", "--lora", lora)) == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert any(k.endswith("magnitude") for k in f.keys()) == (lora == "shared")
    reloaded, in_memory = load_checkpoint(out), prepare(_with_magnitude(), "int8", lora=lora)
    with torch.no_grad():
        assert torch.allclose(reloaded(_ids()).logits, in_memory(_ids()).logits, atol=1e-3)
