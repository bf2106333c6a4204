"""Data-aware conversion (convert/aware.py): calibration statistics, the closed-form shared weight,
whitened SVD LoRA, and their hooks in convert."""

from __future__ import annotations

import pytest
import torch

from looplm.convert import aware, convert, tied_depths, unroll
from looplm.models import ConfigError, LoopLMConfig, LoopLMForCausalLM


def tiny(seed: int = 0, layers: int = 4) -> LoopLMForCausalLM:
    torch.manual_seed(seed)
    cfg = LoopLMConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LoopLMForCausalLM(cfg).eval()
    with torch.no_grad():  # distinct norm weights per depth, so that tying them changes the inputs
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def calibrated():
    model = tiny()
    ids = torch.randint(0, 256, (6, 48), generator=torch.Generator().manual_seed(1))
    return model, ids, aware.collect_calibration(model, ids, batch_size=4)


def spd(n: int, seed: int, tokens: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs X [n, tokens] with anisotropic, correlated channels, and X X^T."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n, dtype=torch.float64)
    x = mix @ torch.randn(n, tokens, generator=g, dtype=torch.float64)
    return x, x @ x.T


# --- calibration ------------------------------------------------------------------------------


def test_calibration_records_every_input_once_and_matches_a_direct_computation(calibrated):
    model, ids, calib = calibrated
    L = model.config.num_hidden_layers
    assert calib.tokens == ids.numel()
    assert set(calib.sums) == {(d, k) for d in range(L) for k in ("attn", "o", "mlp", "down")}
    # q/k/v and gate/up read one recorded matrix each
    assert calib.second_moment(2, "q_proj") is not None
    assert torch.equal(calib.second_moment(2, "k_proj"), calib.second_moment(2, "v_proj"))
    assert torch.equal(calib.second_moment(2, "gate_proj"), calib.second_moment(2, "up_proj"))
    # depth 0's attention input is attn_norm(embedding): recompute it without hooks
    with torch.no_grad():
        x = model.model.layers[0].attn_norm(model.model.embed(ids), 0).reshape(-1, 64).double()
    torch.testing.assert_close(calib.sums[(0, "attn")], x.T @ x, rtol=1e-5, atol=1e-4)
    # the recorded norm weights are the original ones
    torch.testing.assert_close(calib.norm_weights[(3, "mlp")], model.model.layers[3].mlp_norm.weight[0].double())
    # shape of the down_proj input is the FFN width
    assert calib.sums[(1, "down")].shape == (128, 128)


def test_calibration_refuses_a_recursive_model(calibrated):
    model, ids, calib = calibrated
    recursive = convert(model, 2, init="average")
    with pytest.raises(ConfigError):
        aware.collect_calibration(recursive, ids)


def test_text_windows_are_full_length_and_capped():
    class Tok:
        eos_token_id, bos_token_id = 0, 1

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [2 + (ord(c) % 50) for c in text]}

    w = aware.text_windows(Tok(), ["abcdefghij" * 30, "xyz" * 50], seq_len=64, max_tokens=300)
    assert w.shape == (4, 64)  # 300 tokens -> 4 full windows; the partial fifth is dropped
    w = aware.text_windows(Tok(), ["abcdefghij" * 30], seq_len=64, max_tokens=128, add_bos=True)
    assert w.shape[1] == 64 and bool((w[:, 0] == 1).all())


# --- the closed-form shared weight --------------------------------------------------------------


def test_shared_weight_is_the_least_squares_solution():
    torch.manual_seed(0)
    out, n = 12, 10
    xs = [spd(n, seed)[0] for seed in range(3)]
    ws = torch.randn(3, out, n, dtype=torch.float64)
    covs = [x @ x.T for x in xs]
    w = aware.shared_weight(ws, covs)
    # direct solve: min_W sum_d ||W_d X_d - W X_d||^2 as one stacked least-squares problem
    x_cat = torch.cat(xs, 1)
    y_cat = torch.cat([wd @ x for wd, x in zip(ws, xs)], 1)
    direct = torch.linalg.lstsq(x_cat.T, y_cat.T).solution.T
    torch.testing.assert_close(w, direct, rtol=1e-7, atol=1e-8)
    # it is far from the plain average on anisotropic inputs, and better in output error
    err = lambda v: sum(aware.output_error(v, wd, c) for wd, c in zip(ws, covs))  # noqa: E731
    assert err(w) < 0.9 * err(ws.mean(0))


def test_shared_weight_has_zero_gradient_with_damping_and_tends_to_the_average():
    ws = torch.randn(2, 5, 8, dtype=torch.float64)
    covs = [aware.damped(spd(8, s, tokens=4)[1], 0.01) for s in (3, 4)]  # rank-deficient inputs, damped
    w = aware.shared_weight(ws, covs)
    grad = sum((w - wd) @ c for wd, c in zip(ws, covs))
    assert grad.abs().max() < 1e-10 * max(c.abs().max() for c in covs) * ws.abs().max()
    # and the gradient of a perturbed W is not zero (the check can fail)
    bad = sum((w + 1e-3 - wd) @ c for wd, c in zip(ws, covs))
    assert bad.abs().max() > 1e3 * grad.abs().max()
    heavy = [aware.damped(spd(8, s, tokens=4)[1], 1e8, scale=1.0) for s in (3, 4)]  # one ridge for both
    torch.testing.assert_close(aware.shared_weight(ws, heavy), ws.mean(0), rtol=1e-5, atol=1e-6)


# --- whitened SVD -------------------------------------------------------------------------------


def test_whitened_svd_is_exact_at_full_rank_and_optimal_at_low_rank():
    torch.manual_seed(0)
    out, n = 20, 16
    _, cov = spd(n, 7)
    cov = aware.damped(cov, 1e-6)
    resid = torch.randn(out, n, dtype=torch.float64)
    b, a = aware.whitened_svd_factors(resid, cov, n)
    torch.testing.assert_close(b @ a, resid, rtol=1e-9, atol=1e-9)
    for r in (2, 5, 9):
        b, a = aware.whitened_svd_factors(resid, cov, r)
        assert b.shape == (out, r) and a.shape == (r, n)
        aware_err = aware.output_error(b @ a, resid, cov)
        u, s, vh = torch.linalg.svd(resid)
        plain_err = aware.output_error((u[:, :r] * s[:r]) @ vh[:r], resid, cov)
        # Eckart-Young in the whitened space: the error is the tail of R S's spectrum
        tail = torch.linalg.svdvals(resid @ torch.linalg.cholesky(cov))[r:].pow(2).sum()
        assert aware_err == pytest.approx(float(tail), rel=1e-6)
        assert aware_err < 0.8 * plain_err


def test_whitened_svd_equals_plain_svd_for_white_inputs():
    resid = torch.randn(10, 8, dtype=torch.float64)
    b, a = aware.whitened_svd_factors(resid, torch.eye(8, dtype=torch.float64) * 3.0, 3)
    u, s, vh = torch.linalg.svd(resid)
    torch.testing.assert_close(b @ a, (u[:, :3] * s[:3]) @ vh[:3])


# --- through convert ----------------------------------------------------------------------------


@pytest.mark.parametrize("norms", ["tied-avg", "per-depth", "tied-choice"])
@pytest.mark.parametrize("init", ["aware", "average", "stepwise"])
def test_full_rank_aware_svd_restores_the_original(calibrated, norms, init):
    """With norm folding, even tied norms are absorbed by a full-rank aware-svd LoRA."""
    model, ids, calib = calibrated
    relaxed = convert(model, 2, init=init, norms=norms, lora_ranks="full", lora_init="aware-svd", calibration=calib)
    torch.testing.assert_close(relaxed(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_full_rank_plain_svd_with_tied_norms_does_not_restore(calibrated):
    """The control for the test above: plain SVD cannot undo the tied norms, so that test can fail."""
    model, ids, calib = calibrated
    relaxed = convert(model, 2, init="average", norms="tied-avg", lora_ranks="full", lora_init="svd")
    assert (relaxed(ids).logits - model(ids).logits).abs().max() > 1e-2


def test_aware_init_minimises_the_output_error_of_every_linear(calibrated):
    model, _, calib = calibrated
    calib_pd = aware.Calibration(**{**calib.__dict__, "fold_norms": False})
    kw = dict(loops=2, norms="per-depth", lora_ranks=0)
    conv = {i: convert(model, init=i, calibration=calib_pd, **kw) for i in ("aware", "average", "stepwise")}
    depths_of = tied_depths(conv["aware"].config)
    for k, depths in enumerate(depths_of):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):

            def err(m):
                lin = dict(m.model.layers[k].named_modules())[("attn." if name[0] in "qkvo" else "mlp.") + name]
                return sum(
                    aware.output_error(
                        lin.weight,
                        dict(model.model.layers[d].named_modules())[
                            ("attn." if name[0] in "qkvo" else "mlp.") + name
                        ].weight,
                        calib.second_moment(d, name),
                    )
                    for d in depths
                )

            e = {i: err(m) for i, m in conv.items()}
            assert e["aware"] <= e["average"] * (1 + 1e-6) and e["aware"] <= e["stepwise"] * (1 + 1e-6), (k, name, e)


def test_aware_svd_beats_svd_in_layer_output_error_at_equal_rank(calibrated):
    model, _, calib = calibrated
    calib_pd = aware.Calibration(**{**calib.__dict__, "fold_norms": False, "damp": 1e-8})
    relaxed = {
        li: convert(model, 2, init="average", norms="per-depth", lora_ranks=8, lora_init=li, calibration=calib_pd)
        for li in ("svd", "aware-svd")
    }
    config = relaxed["svd"].config
    totals = {"svd": 0.0, "aware-svd": 0.0}
    for d, (k, slot) in enumerate(zip(config.layer_map, config.slot_map)):
        for li, m in relaxed.items():
            for path, lin in m.model.layers[k].named_modules():
                if hasattr(lin, "merged_weight"):
                    orig = dict(model.model.layers[d].named_modules())[path].weight
                    totals[li] += aware.output_error(
                        lin.merged_weight(slot), orig, calib.second_moment(d, path.rsplit(".", 1)[-1])
                    )
    assert totals["aware-svd"] < 0.9 * totals["svd"], totals


@pytest.mark.parametrize("norms,fold", [("per-depth", False), (None, True)])
def test_stepwise_tied_depth_keeps_the_zero_init_rule(calibrated, norms, fold):
    """Stepwise copies layers 0 and 3 (L=4, B=2): depth 0 (slot 0 of shared layer 0) and depth 3 (slot 1
    of shared layer 1) are the pretrained layers themselves, so their LoRAs get the zero init."""
    model, _, calib = calibrated
    calib = aware.Calibration(**{**calib.__dict__, "fold_norms": fold})
    relaxed = convert(model, 2, init="stepwise", norms=norms, lora_ranks=4, lora_init="aware-svd", calibration=calib)
    q0, q1 = relaxed.model.layers[0].attn.q_proj, relaxed.model.layers[1].attn.q_proj
    assert not q0.lora_B[0].any() and q0.lora_A[0].any()  # depth 0 = layer 0
    assert q0.lora_B[1].any()  # depth 2 differs from layer 0
    assert q1.lora_B[0].any()  # depth 1 differs from layer 3
    assert not q1.lora_B[1].any() and q1.lora_A[1].any()  # depth 3 = layer 3


def test_data_aware_inits_need_statistics_of_the_same_model(calibrated):
    model, _, calib = calibrated
    with pytest.raises(ConfigError, match="calibration"):
        convert(model, 2, init="aware")
    with pytest.raises(ConfigError, match="calibration"):
        convert(model, 2, init="average", lora_ranks=4, lora_init="aware-svd")
    convert(model, 2, init="average", lora_ranks=0, lora_init="aware-svd")  # no LoRA: nothing to calibrate
    with pytest.raises(ConfigError, match="layers"):
        convert(tiny(layers=6), 2, init="aware", calibration=calib)


def test_calibration_round_trips_through_a_file(calibrated, tmp_path):
    model, ids, calib = calibrated
    calib.save(tmp_path / "c.pt")
    back = aware.Calibration.load(tmp_path / "c.pt")
    assert back.tokens == calib.tokens and torch.equal(back.sums[(1, "down")], calib.sums[(1, "down")])
    a = convert(model, 2, init="aware", lora_ranks=4, lora_init="aware-svd", calibration=back)
    b = convert(model, 2, init="aware", lora_ranks=4, lora_init="aware-svd", calibration=calib)
    torch.testing.assert_close(a(ids).logits, b(ids).logits)
    assert torch.equal(unroll(a).model.layers[3].mlp.down_proj.weight, unroll(b).model.layers[3].mlp.down_proj.weight)


def test_shares_text_finds_heldout_passages():
    held = " ".join(f"line {i} of the held out poem, with words" for i in range(60))
    assert aware.shares_text(["prefix " + held[500:900] + " suffix"], held)
    assert not aware.shares_text(["an entirely different training text " * 40], held)
