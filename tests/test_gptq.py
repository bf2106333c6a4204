"""GPTQ rounding (models/gptq.py, `looplm quantize --calibrate`): a lower output error than rounding to nearest
on correlated inputs, weights already on the grid kept, each depth's inputs recorded under its slot, a
quantized model closer to the float one, and the command's record and refusals."""

import copy

import pytest
import torch
from conftest import quantize_args
from test_train_fixtures import build_corpus, byte_tokenizer, make_models, tiny_vanilla

from looplm.commands import main
from looplm.convert import convert
from looplm.models import gptq as G
from looplm.models import load_model
from looplm.models import quantized as Q

FORMATS = [f for f in ("int8", "int4") if f in Q.supported_formats("cpu")]


def correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels are strongly correlated (most of their energy in a few directions) and unevenly
    scaled, as a layer's normed hidden states are."""
    g = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(n, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
    return (low_rank + 0.3 * torch.randn(n, k, generator=g)) * torch.linspace(0.2, 3, k)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gptq_lowers_the_output_error_on_correlated_inputs(fmt):
    torch.manual_seed(1)
    w, x = torch.randn(48, 128), correlated_inputs(2048, 128)
    h = (x.T @ x).double()
    nearest, gptq = Q.portable(w, fmt), G.gptq_portable(w, h, fmt)
    assert G.output_error(w, gptq, h) < 0.8 * G.output_error(w, nearest, h)
    # the same portable form as rounding to nearest: codes within the format's range, one pair per group/row
    for key, t in nearest.items():
        assert gptq[key].shape == t.shape and gptq[key].dtype == t.dtype
    if fmt == "int4":
        assert gptq["scale"].shape == (48, 128 // Q.DEFAULT_GROUP)
    if fmt in FORMATS:  # and the kernel multiplies by exactly its dequantized weight
        y = Q.make_weight(gptq, torch.float32).linear(x[:5])
        assert torch.allclose(y, x[:5] @ Q.dequantize(gptq).t(), rtol=1e-5, atol=1e-3)


def test_gptq_keeps_a_weight_already_on_the_grid():
    torch.manual_seed(2)
    w = Q.dequantize(Q.portable(torch.randn(32, 64), "int4"))  # every group exactly on a 4-bit grid
    x = correlated_inputs(512, 64)
    t = G.gptq_portable(w, (x.T @ x).double(), "int4")
    assert torch.allclose(Q.dequantize(t), w, atol=1e-6)


def test_a_grid_whose_codes_miss_0_and_15_round_trips():
    """GPTQ picks a group's grid before its error feedback moves the group's later columns, so its codes need
    not reach 0 or 15; rounding such a weight to nearest again must give it back (heal --base-weights relies
    on it: the weights it leaves are served by `looplm quantize`)."""
    torch.manual_seed(3)
    codes = torch.randint(2, 14, (16, 64)).float().reshape(16, 2, 32)
    scale, low = torch.rand(16, 2, 1) * 0.01 + 1e-3, torch.randn(16, 2, 1) * 0.01
    w = (codes * scale + low).reshape(16, 64)
    assert Q.relative_error(w, "int4") < 1e-6


def test_the_grid_step_sort_is_paid_only_by_weights_on_a_grid(monkeypatch):
    """The sort behind the grid-step candidate costs a quarter of an int4 load; a float weight (32 distinct values
    per group) and a grid the ranges already reproduce must not pay it, a grid whose codes miss 0 and 15 must."""
    from looplm.models import grids

    calls = []
    real = grids._grid_step
    monkeypatch.setattr(grids, "_grid_step", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(4)
    w = torch.randn(64, 128)
    grids.int4_portable(w)
    assert calls == []
    grids.int4_portable(Q.dequantize(Q.portable(w, "int4")))  # on a grid whose codes reach 0 and 15: the ranges
    assert calls == []  # reproduce it (a Q4_1 model's weights are such)
    codes = torch.randint(2, 14, (64, 4, 32)).float()  # codes missing 0 and 15, as GPTQ's may
    gridded = (codes * (torch.rand(64, 4, 1) * 0.01 + 1e-3) + torch.randn(64, 4, 1) * 0.01).reshape(64, 128)
    assert Q.relative_error(gridded, "int4") < 1e-6
    assert calls == [1]


def test_input_moments_record_each_depth_under_its_slot():
    """A full-rank per-depth conversion is the original model, so loop 2's inputs to shared layer 0 are the
    original's inputs to layer 2 (cycle: depth d runs layer d mod 2 with slot d // 2)."""
    vanilla = tiny_vanilla(layers=4)
    looped = convert(vanilla, loops=2, init="average", norms="per-depth", lora_ranks="full", lora_init="svd")
    rows = torch.randint(0, 260, (3, 24))
    want, got = G.input_moments(vanilla, rows, batch_size=2), G.input_moments(looped, rows, batch_size=2)
    assert sorted(got["model.layers.0.mlp.down_proj"]) == [0, 1]
    for depth in range(4):
        for lin in ("attn.q_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            a, b = got[f"model.layers.{depth % 2}.{lin}"][depth // 2], want[f"model.layers.{depth}.{lin}"][0]
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())
    tokens = rows.numel()  # the head's input is the final norm's output: one row per token
    assert got["lm_head"].shape == (64, 64) and torch.allclose(got["lm_head"], want["lm_head"], rtol=1e-3, atol=1e-2)
    assert torch.allclose(
        torch.diag(want["lm_head"]).sum() / tokens, torch.tensor(64.0, dtype=torch.float64), rtol=0.5
    )  # RMS-normed rows with unit weights: about 1 per channel


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lora", ["shared", "merged"])
def test_a_gptq_model_is_closer_to_the_float_one(fmt, lora):
    torch.manual_seed(0)
    model = convert(tiny_vanilla(layers=4), loops=2, init="average", lora_ranks=8, lora_init="svd").eval()
    rows = torch.randint(0, 260, (2, 16))  # 32 tokens for 64 channels: the inputs span half the space, as
    moments = G.input_moments(model, rows)  # a real model's correlated ones nearly do; GPTQ uses the rest
    # The layers only: this toy's tied head rounded for its output moves the embedding rows it shares more than
    # rounding to nearest does, and on this random model that costs more than it gains (on SmolLM2 it pays:
    # docs/guides/quantize-export.md). The head's own output error is checked below.
    layers_only = {k: v for k, v in moments.items() if k != "lm_head"}
    with torch.no_grad():
        ref = model(rows).logits
        errors = {}
        for rounding, m in (("nearest", None), ("gptq", layers_only)):
            q = Q.quantize_model(copy.deepcopy(model), fmt, lora=lora, act_dtype=torch.float32, moments=m)
            assert q.config.quantization["rounding"] == rounding
            errors[rounding] = (q(rows).logits - ref).norm().item()
    assert errors["gptq"] < 0.8 * errors["nearest"]
    tensors = Q.quantize_portable(model, fmt, lora=lora, moments=moments)
    for name, lin in Q.linears(model):  # every weight's own output error is lower too, on its depths' inputs
        for s, key in enumerate(Q.weight_names(name, lin, lora)):
            merged = Q.merges(lin, lora)
            w = lin.merged_weight(s) if merged else lin.weight
            h = moments[name][s] if merged else sum(moments[name].values())
            assert G.output_error(w, tensors[key], h) < G.output_error(w, Q.portable(w, fmt), h)
    head, h = model.lm_head.weight, moments["lm_head"]  # tied: the embedding's table is rounded for the head
    assert G.output_error(head, tensors["model.embed_tokens.weight"], h) < G.output_error(
        head, Q.int8_portable(head), h
    )


@pytest.mark.skipif(not FORMATS, reason="this torch build runs neither weight-only op on CPU")
def test_quantize_calibrate_command(tmp_path, capsys):
    models = make_models(tmp_path)
    corpus = build_corpus(tmp_path, models["student"], seq_len=32)
    out = tmp_path / "q"
    fmt = FORMATS[-1]
    calibrated = ("--calib-data", corpus, "--calib-rows", 4, "--no-equalize")
    assert main(quantize_args(models["student"], out, "--weights", fmt, *calibrated)) == 0
    assert "GPTQ on 128 calibration tokens" in capsys.readouterr().out
    back, _ = load_model(out)
    rec = back.config.quantization
    assert rec["rounding"] == "gptq" and rec["calibration"] == {
        "data": str(corpus),
        "split": "train",
        "rows": 4,
        "tokens": 128,
    }
    # refusals: one line, exit code 2, nothing written
    for bad, msg in (
        (["--calib-rows", "0"], "must be positive"),
        (["--calib-data", str(tmp_path / "none")], "does not exist"),
    ):
        assert main(quantize_args(models["student"], tmp_path / "bad", *bad)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and msg in err and not (tmp_path / "bad").exists()
    other = tmp_path / "other"
    from looplm.models import save_model

    save_model(load_model(models["student"])[0], byte_tokenizer("<extra>"), other)  # another vocabulary
    assert main(quantize_args(other, tmp_path / "bad", "--calib-data", corpus)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another tokenizer" in err
