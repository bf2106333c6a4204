"""int8/int4 weights (models/quantized.py): products within the quantization bound, the engine on quantized
weights equal to a float model built from the dequantized weights, LoRA on top, no float copy kept, refusal
of formats a platform cannot run, stacked input projections equal to separate ones, and quantized checkpoints
(round trip, corruption refused)."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import arrive_one_per_step, full_depth_greedy
from conftest import small_relaxed as _relaxed

from looplm.commands import main
from looplm.errors import ConfigError, UsageError
from looplm.models import load_model, save_model
from looplm.models import quantized as Q
from looplm.models.layers import LoopLinear
from looplm.models.loading import save_quantized
from looplm.serve import Engine, Request, make_scheduler

FORMATS = [f for f in ("int8", "int4") if f in Q.supported_formats("cpu")]
pytestmark = pytest.mark.skipif(not FORMATS, reason="this torch build runs neither weight-only op on CPU")


def dequantized_reference(model, fmt, group=Q.DEFAULT_GROUP, head="int8"):
    """A float model whose every quantized weight is replaced by its dequantized value (head untied
    where the quantized model has its own head)."""
    ref = copy.deepcopy(model)
    tensors = Q.quantize_portable(ref, fmt, group, head)
    with torch.no_grad():
        for name, t in tensors.items():
            if name == "lm_head.weight":
                ref.lm_head.weight = torch.nn.Parameter(Q.dequantize(t))
            else:
                ref.get_parameter(name).copy_(Q.dequantize(t))
    return ref


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_quantized_matmul_within_the_rounding_bound(fmt, rows):
    torch.manual_seed(rows)
    w, x, b = torch.randn(96, 128), torch.randn(rows, 128), torch.randn(96)
    t = Q.portable(w, fmt)
    qw = Q.make_weight(t, torch.float32)  # float32 activations: the exact path
    y = qw.linear(x, b)
    deq = Q.dequantize(t)
    # the kernel multiplies by exactly the dequantized weight (float32 summation order aside)
    assert torch.allclose(y, x @ deq.t() + b, rtol=1e-5, atol=1e-4)
    if fmt == "int8":  # every weight within half a step, so the product within sum_k |x_k| * step_k / 2
        step = t["scale"][:, None].expand_as(w)
        assert ((deq - w).abs() <= step / 2 + 1e-6).all()
        bound = x.abs() @ (step / 2).t()
        assert ((y - (x @ w.t() + b)).abs() <= bound + 1e-4).all()
    else:  # int4 fits each group's range to the weight (next test): no group worse than its [min, max] grid
        assert (_group_sq_err(w, deq) <= _group_sq_err(w, _round_to_nearest_int4(w)) + 1e-6).all()
    assert (y - (x @ w.t() + b)).abs().max() > 0  # it is quantized
    # the kernel's own form reads back as the portable one
    assert torch.allclose(qw.dequantize(), deq, atol=1e-5)


@pytest.mark.skipif("int8" not in FORMATS, reason="needs the int8 op")
@pytest.mark.parametrize("columns", [128, 40, 100])
def test_int8_takes_weights_and_activations_wherever_they_lie(columns):
    """Weights at a file offset (as a safetensors load leaves them), activations that are views into a larger
    tensor, and input widths off a multiple of 16: on a CPU where the int8 op takes its AVX-512 path each of
    these crashed the process or gave NaN (a Xeon with AMX, torch 2.13). Run in a child process, so that a crash
    fails this test instead of ending the suite."""
    code = f"""
import torch
from looplm.models import quantized as Q
torch.manual_seed(0)
w = torch.randn(48, {columns})
t = Q.portable(w, "int8")
storage = torch.zeros(t["q"].numel() + 40, dtype=torch.int8)
storage[40:].copy_(t["q"].flatten())
t["q"] = storage[40:].view(48, {columns})                # 40 bytes past an aligned start
qw = Q.make_weight(t, torch.bfloat16)
x = torch.randn(5 * {columns} + 8).bfloat16()[8:].view(5, {columns})   # 16 bytes past an aligned start
y = qw.linear(x).float()
want = x.float() @ (Q.dequantize(Q.portable(w, "int8"))).t()
assert torch.isfinite(y).all()
assert (y - want).abs().max() <= 0.02 * want.abs().max(), (y - want).abs().max()
assert torch.equal(qw.rows(torch.tensor([3]), torch.float32)[0], t["q"][3].float() * qw.scale[3].float())
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


@pytest.mark.skipif("int8" not in FORMATS, reason="needs the int8 op")
@pytest.mark.skipif(
    not any(__import__("shutil").which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile on CPU needs a C++ compiler",
)
@pytest.mark.parametrize("rows_out,columns", [(96, 128), (54, 40), (7, 100)])
def test_int8_products_are_streamed_for_one_compiled_row_and_dense_for_many(rows_out, columns, monkeypatch):
    """Inside a compiled graph an int8 weight multiplies one row as ``int8_gemv`` (in 4, 3 or 1 blocks of rows: the
    most, up to four, that divide the row count; input widths padded in memory); ``DENSE_ROWS`` rows or more, compiled
    or not, as ``int8_dense`` (a bfloat16 GEMM, where this CPU multiplies bfloat16 natively): the same products as the
    op, to bfloat16 rounding. The row counts between take the op."""
    torch._dynamo.reset()  # the lambda's code is every parametrization's: three graphs each
    torch.manual_seed(columns)
    w = Q.make_weight(Q.portable(torch.randn(rows_out, columns), "int8"), torch.bfloat16)
    assert w.dense == Q.has_bf16_matmuls("cpu")
    deq = w.dequantize()
    calls, gemv, dense = [], Q.int8_gemv, Q.int8_dense
    monkeypatch.setattr(Q, "int8_gemv", lambda *a: calls.append(("gemv", tuple(a[0].shape))) or gemv(*a))
    monkeypatch.setattr(Q, "int8_dense", lambda *a: calls.append(("dense", a[2].shape[0])) or dense(*a))
    compiled = torch.compile(lambda x: w.linear(x), fullgraph=True, dynamic=False)
    many = Q.DENSE_ROWS + 4
    xs = [torch.randn(rows, columns) for rows in (1, 3, many)]
    got = [compiled(x) for x in xs]
    assert calls == [("gemv", (rows_out, columns))] + [("dense", many)] * w.dense
    calls.clear()
    for x, y in zip(xs, got):
        want, tol = x.bfloat16().float() @ deq.t(), 2e-2 * float(y.abs().max())  # bfloat16 outputs
        assert y.dtype == x.dtype and y.shape == (x.shape[0], rows_out)
        torch.testing.assert_close(y, want, rtol=2e-2, atol=tol)
        torch.testing.assert_close(y, w.linear(x), rtol=2e-2, atol=tol)
    assert calls == [("dense", many)] * w.dense  # eager: the op for one and three rows


@pytest.mark.skipif(
    "int8" not in FORMATS or not Q.has_bf16_matmuls("cpu"), reason="needs the int8 op and native bfloat16 products"
)
def test_int8_dense_serves_the_layers_and_never_a_vocabulary_sized_head(monkeypatch):
    """Only weights whose bfloat16 temporary fits ``DENSE_MAX_BYTES`` take ``int8_dense``: on SmolLM2 every layer's
    (gate|up: 3.5 MB), never the LM head's (56 MB, which cost a fixed 22 ms a step). Here the bound
    sits between a small model's stacked layers (32 KB) and its tied head (128 KB): a 20-token forward multiplies every
    layer dense and the head through the op, with the dequantized model's logits; float32 activations never go dense."""
    monkeypatch.setattr(Q, "DENSE_MAX_BYTES", 64 * 2**10)
    model = _relaxed(vocab_size=1024)
    qm = Q.quantize_model(copy.deepcopy(model), "int8")
    calls, dense = [], Q.int8_dense
    monkeypatch.setattr(Q, "int8_dense", lambda *a: calls.append(tuple(a[0].shape)) or dense(*a))
    ids = torch.randint(0, 1024, (1, Q.DENSE_ROWS + 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = qm(ids).logits
        want = dequantized_reference(model, "int8")(ids).logits
    hidden = model.config.hidden_size
    assert calls and (1024, hidden) not in calls and not qm.lm_head.weight_q.dense
    assert {shape for shape in calls} == {
        (w.out_features, w.in_features) for w in qm.modules() if isinstance(w, Q.Int8Weight) and w.dense
    }
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.abs().max()))  # bfloat16 activations
    assert not Q.make_weight(Q.portable(torch.randn(64, 32), "int8"), torch.float32).dense


def _round_to_nearest_int4(w, g=32):
    """Plain round-to-nearest over each group's [min, max] range (what int4 did before its ranges were fitted)."""
    wg = w.reshape(w.shape[0], -1, g)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    return (torch.round((wg - lo) / scale).clamp(0, 15) * scale + lo).reshape(w.shape)


def _group_sq_err(w, deq, g=32):
    return ((deq - w) ** 2).reshape(w.shape[0], -1, g).sum(-1)


def test_int4_ranges_are_fitted_to_the_float_weight():
    """Each group's scale and minimum are chosen against the float weight: heavy-tailed weights (as trained
    ones are) lose less than round-to-nearest over [min, max], no group loses more, and weights already on a
    4-bit grid (like the embedded Q4_1 model's) still round-trip exactly."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((64, 256)) * 0.02
    t = Q.int4_portable(w)
    fitted, plain = _group_sq_err(w, Q.dequantize(t)), _group_sq_err(w, _round_to_nearest_int4(w))
    assert (fitted <= plain + 1e-9).all()
    assert fitted.sum() < 0.95 * plain.sum(), (fitted.sum() / plain.sum()).item()  # 0.92 here
    codes = torch.randint(0, 16, (64, 256), generator=g).float()
    codes[:, 0::32], codes[:, 1::32] = 0, 15  # each group spans the whole grid, as a dequantized Q4_1 block may
    scale, lo = torch.rand(64, 8, 1, generator=g) * 0.01 + 1e-3, torch.randn(64, 8, 1, generator=g) * 0.05
    on_grid = (codes.reshape(64, 8, 32) * scale + lo).reshape(64, 256)
    assert torch.allclose(Q.dequantize(Q.int4_portable(on_grid)), on_grid, atol=1e-6)


def test_relative_error_is_the_frobenius_ratio_of_the_rounding():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    for fmt in ("int8", "int4"):
        want = ((w - Q.dequantize(Q.portable(w, fmt))).norm() / w.norm()).item()
        assert Q.relative_error(w, fmt) == pytest.approx(want, rel=1e-6)
    assert 0 < Q.relative_error(w, "int8") < Q.relative_error(w, "int4") < 0.2
    assert Q.relative_error(torch.full((4, 32), 0.5), "int8") == pytest.approx(0.0, abs=1e-7)


def test_int4_group_falls_back_to_a_size_that_divides():
    t = Q.int4_portable(torch.randn(8, 96), group=64)  # 96 = 3 x 32: groups of 32
    assert t["scale"].shape == (8, 3)
    with pytest.raises(UsageError, match="divisible by 32"):
        Q.int4_portable(torch.randn(8, 40))


@pytest.mark.parametrize("fmt,head", [(f, h) for f in FORMATS for h in FORMATS])
def test_forward_equals_the_dequantized_float_model_with_lora_on_top(fmt, head):
    model = _relaxed()
    ref = dequantized_reference(model, fmt, head=head)
    qm = Q.quantize_model(copy.deepcopy(model), fmt, head=head, act_dtype=torch.float32)
    assert isinstance(qm.lm_head.weight_q, Q.Int8Weight if head == "int8" else Q.Int4Weight)
    assert (qm.lm_head.weight_q is qm.model.embed_tokens.weight_q) == (head == "int8")  # tied: one table
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        out, want = qm(ids).logits, ref(ids).logits
        assert torch.allclose(out, want, atol=1e-4), (out - want).abs().max()
        # the LoRA is float and in use: without it the logits move
        lin = qm.model.layers[0].attn.q_proj
        assert lin.lora_B.dtype == torch.float32 and lin.weight is None and lin.quant is not None
        lin.lora_B.zero_()
        assert not torch.allclose(qm(ids).logits, out, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stacked_input_projections_equal_separate_ones(fmt):
    """q|k|v and gate|up as one stacked weight each (the default): the same logits and engine output as five
    separate matmuls, biases and LoRA per projection on top, and no byte more."""
    model = _relaxed(attention_bias=True)
    fused = Q.quantize_model(copy.deepcopy(model), fmt, act_dtype=torch.float32)
    plain = Q.quantize_model(copy.deepcopy(model), fmt, act_dtype=torch.float32, fuse=False)
    attn, mlp = fused.model.layers[0].attn, fused.model.layers[0].mlp
    assert attn.qkv.sizes == [64, 32, 32] and mlp.gate_up.sizes == [128, 128]
    assert isinstance(attn.k_proj.quant, Q.QuantSlice) and attn.k_proj.quant.stacked is attn.qkv
    assert plain.model.layers[0].attn.qkv is None and isinstance(attn.o_proj.quant, Q.QuantWeight)
    assert Q.weight_bytes(fused) == Q.weight_bytes(plain)
    assert torch.equal(attn.v_proj.merged_weight(1), plain.model.layers[0].attn.v_proj.merged_weight(1))
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.allclose(fused(ids).logits, plain(ids).logits, atol=1e-5)
        assert torch.allclose(
            attn.k_proj(torch.ones(1, 64), 1), plain.model.layers[0].attn.k_proj(torch.ones(1, 64), 1), atol=1e-5
        )  # a member called alone (a prefix's keys) reads its slice
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    assert _serve(fused, prompts, 6)[1] == _serve(plain, prompts, 6)[1]


def _serve(model, prompts, n, scheduler="depth", **kw):
    engine = Engine(model, max_batch=3, max_seq_len=64, **kw)
    sched = make_scheduler(scheduler, engine)
    reqs = [Request(p, n) for p in prompts]
    arrive_one_per_step(sched, reqs)
    return engine, [r.output for r in reqs]


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_on_quantized_weights_equals_the_dequantized_models_greedy_output(fmt):
    model = _relaxed()
    ref = dequantized_reference(model, fmt)
    qm = Q.quantize_model(copy.deepcopy(model), fmt, act_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (5, 11, 1, 8)]
    want = [full_depth_greedy(ref, p, 7) for p in prompts]
    engine, got = _serve(qm, prompts, 7)
    assert engine.stats["mixed_stages"] > 0 and engine.packed_bytes == 0
    assert got == want
    # and the float model decodes differently somewhere (the test can tell the formats apart)
    if fmt == "int4":
        assert [full_depth_greedy(model, p, 7) for p in prompts] != want


def test_no_float_copy_is_kept_and_memory_drops():
    model = _relaxed(
        hidden_size=256, intermediate_size=512, vocab_size=2048, num_attention_heads=4, num_key_value_heads=2
    )
    Engine(model, max_batch=1, max_seq_len=8)  # the float engine attaches its CPU ways (packed where fastest)
    fp32 = Q.weight_bytes(model)
    for fmt, factor in (("int8", 3.0), ("int4", 3.0)):
        if fmt not in FORMATS:
            continue
        qm = Q.quantize_model(copy.deepcopy(model), fmt)
        engine = Engine(qm, max_batch=1, max_seq_len=8)
        lins = [m for m in qm.modules() if isinstance(m, LoopLinear)]
        assert all(m.weight is None and m.cpu_weight is None for m in lins)
        assert engine.packed_bytes == 0 and not isinstance(qm.lm_head, torch.nn.Linear)
        assert not any(p.numel() >= 256 * 256 for p in qm.parameters() if "lora" not in str(p.shape))
        assert fp32 / Q.weight_bytes(qm) >= factor, (fmt, fp32, Q.weight_bytes(qm))


def test_unsupported_format_or_device_is_a_usage_error(monkeypatch, capsys):
    with pytest.raises(UsageError, match="supported here: fp32$"):
        Q.check_format("int4", "cuda")
    with pytest.raises(UsageError, match="int8, int4"):
        Q.check_format("int5", "cpu")
    # a CPU whose torch cannot run the int4 op: refused, never served as something else
    monkeypatch.setattr(Q, "_kernel_runs", lambda fmt: fmt == "int8")
    with pytest.raises(UsageError, match="supported here: fp32, int8"):
        Q.quantize_model(_relaxed(), "int4")
    # the command: one line, exit code 2, before any model loads
    assert main(["serve", "no-such-model", "--device", "cuda", "--weights", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "supported here: fp32" in err


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_checkpoint_round_trip(tmp_path, fmt):
    model = _relaxed()
    src = save_model(model, None, tmp_path / "float")
    assert main(["quantize", str(src), "--out", str(tmp_path / "q"), "--weights", fmt]) == 0
    back, _ = load_model(tmp_path / "q")
    assert Q.stored_format(back) == fmt and Q.is_quantized(back)
    assert not any(p.device.type == "meta" for p in list(back.parameters()) + list(back.buffers()))
    from looplm.convert import count_parameters

    assert count_parameters(back) == count_parameters(model)  # `looplm info` counts quantized weights too
    mem = Q.quantize_model(copy.deepcopy(model), fmt)  # bfloat16 activations by default, stored and loaded alike
    assert back.model.layers[0].mlp.up_proj.quant.dtype == torch.bfloat16
    ids = torch.randint(0, 256, (1, 13))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, mem(ids).logits)
    # serving it as stored works; asking for another format is refused
    assert Q.prepare(back, None) is back and Q.prepare(back, fmt) is back
    with pytest.raises(UsageError, match=f"stored with {fmt}"):
        Q.prepare(back, "int8" if fmt == "int4" else "int4")
    # a quantized model is not saved as if it were float
    with pytest.raises(ConfigError, match="looplm quantize"):
        save_model(back, None, tmp_path / "again")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_activations_stay_close(dtype):
    """The default: the quantized matmuls take bfloat16 inputs; the model keeps ``dtype`` elsewhere."""
    model = _relaxed()
    fmt = FORMATS[0]
    qm = Q.quantize_model(copy.deepcopy(model), fmt, dtype=dtype)
    ref = dequantized_reference(model, fmt)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert qm.model.embed(ids).dtype == dtype
        out, want = qm(ids).logits.float(), ref(ids).logits
    assert qm.model.layers[0].attn.q_proj.lora_A.dtype == dtype
    assert qm.model.layers[0].attn.q_proj.quant.dtype == torch.bfloat16
    assert 0 < (out - want).abs().max() < 0.05 * want.abs().max()


def test_a_corrupt_or_truncated_quantized_dir_is_refused(tmp_path, capsys):
    model = _relaxed()
    d = save_quantized(model, None, tmp_path / "q", FORMATS[0], Q.DEFAULT_GROUP)
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="checksum"):
        load_model(d)
    weights.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        load_model(d)
    assert main(["info", str(d)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# --- the LoRA merged into one quantized weight per depth (lora="merged") ------------------------------------


class _FloatPerDepth(torch.nn.Module):
    """A hand-written reference for PerDepthWeight: float weights, every depth computed for every row and
    each row's own depth selected (no grouping)."""

    def __init__(self, weights):
        super().__init__()
        self.w = weights

    def linear(self, x, bias=None, slot=0):
        if isinstance(slot, int):
            y = torch.nn.functional.linear(x, self.w[slot])
        else:
            every = torch.stack([torch.nn.functional.linear(x, w) for w in self.w])  # [S, ..., out]
            y = every.gather(0, slot[None, ..., None].expand(1, *x.shape[:-1], every.shape[-1]))[0]
        return y if bias is None else y + bias

    def dequantize(self, slot=0):
        return self.w[slot]


def merged_reference(model, fmt):
    """A float model whose linears multiply with the dequantized W' + B_s A_s of their depth s, the LoRA
    gone, and the embedding and head dequantized as the quantized model holds them."""
    ref = dequantized_reference(model, fmt)  # embedding, head (and shared weights, replaced below)
    tensors = Q.quantize_portable(model, fmt, lora="merged")
    for n, lin in Q.linears(ref):
        names = Q.weight_names(n, lin, "merged")
        lin.quant = _FloatPerDepth([Q.dequantize(tensors[name]) for name in names])
        lin.weight, lin.lora_A, lin.lora_B = None, None, None
    return ref


@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_lora_equals_per_depth_dequantized_weights(fmt):
    """With lora="merged" each depth multiplies with its own quantized W' + B_s A_s: the model's logits, a
    linear called with one depth or with a per-row mix of depths, and the engine's greedy output (mixed-depth
    steps included) equal a float model built from those weights; no LoRA is left, and stacking holds."""
    model = _relaxed(attention_bias=True)
    ref = merged_reference(model, fmt)
    qm = Q.quantize_model(copy.deepcopy(model), fmt, act_dtype=torch.float32, lora="merged")
    assert qm.config.quantization["lora"] == "merged"
    assert not any("lora" in n for n, _ in qm.named_parameters())
    attn = qm.model.layers[0].attn
    assert isinstance(attn.qkv, Q.PerDepthWeight) and len(attn.qkv.depths) == 2 and attn.qkv.sizes == [64, 32, 32]
    # the merged weight is the float model's depth weight, quantized
    lin, float_lin = qm.model.layers[1].mlp.down_proj, model.model.layers[1].mlp.down_proj
    for s in range(2):
        want = Q.dequantize(Q.portable(float_lin.merged_weight(s), fmt))
        assert torch.allclose(lin.merged_weight(s), want, atol=1e-5)
    assert not torch.allclose(lin.merged_weight(0), lin.merged_weight(1))
    x, mix = torch.randn(2, 5, 128), torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    ref_lin = ref.model.layers[1].mlp.down_proj
    with torch.no_grad():
        for slot in (0, 1, mix):
            assert torch.allclose(lin(x, slot), ref_lin(x, slot), atol=1e-4)
        ids = torch.randint(0, 256, (2, 11))
        assert torch.allclose(qm(ids).logits, ref(ids).logits, atol=1e-4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (L,), generator=g).tolist() for L in (5, 11, 1, 8)]
    engine, got = _serve(qm, prompts, 7)
    assert engine.stats["mixed_stages"] > 0
    assert got == [full_depth_greedy(ref, p, 7) for p in prompts]


@pytest.mark.parametrize("fmt", FORMATS)
def test_merged_lora_checkpoint_round_trip_and_refusals(tmp_path, fmt, capsys):
    model = _relaxed()
    src = save_model(model, None, tmp_path / "float")
    assert main(["quantize", str(src), "--out", str(tmp_path / "q"), "--weights", fmt, "--lora", "merged"]) == 0
    back, _ = load_model(tmp_path / "q")
    assert Q.stored_lora(back) == "merged" and Q.stored_format(back) == fmt
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert not any("lora" in k for k in keys) and any(".depth1.weight." in k for k in keys)
    from looplm.convert import count_parameters

    got, want = count_parameters(back), count_parameters(model)
    shared = sum(m.out_features * m.in_features for _, m in Q.linears(model))  # one more copy per extra depth
    assert got["lora"] == 0 and got["n_emb"] == want["n_emb"] - want["lora"] + shared
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q")]) == 0 and "each depth's LoRA merged" in capsys.readouterr().out
    mem = Q.quantize_model(copy.deepcopy(model), fmt, lora="merged")
    ids = torch.randint(0, 256, (1, 13))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, mem(ids).logits)
    # served as stored; asking for the other LoRA mode, or merging float weights, is refused
    assert Q.prepare(back, None) is back and Q.prepare(back, fmt, lora="merged") is back
    with pytest.raises(UsageError, match="stored with merged LoRA"):
        Q.prepare(back, fmt, lora="shared")
    with pytest.raises(UsageError, match="needs quantized weights"):
        Q.prepare(copy.deepcopy(model), None, lora="merged")
    capsys.readouterr()
    assert main(["generate", str(src), "x", "--weights", "fp32", "--lora", "merged"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs quantized weights" in err


@pytest.mark.skipif("int8" not in FORMATS, reason="needs the int8 op")
def test_the_head_rescores_its_leading_logits_in_float32():
    """Two tokens whose logits (about 19.2) differ by 0.003, far below bfloat16's step there (0.125): the kernel's
    bfloat16 logits tie them, and argmax would take the first; the rescored head ranks them as the int8 weight
    in float32 does."""
    q = torch.randint(-20, 20, (300, 64), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    q[3] = 100
    q[5] = 100
    q[5, 0] = 101
    head = Q.QuantHead(Q.Int8Weight(q, torch.full((300,), 0.006), torch.bfloat16))
    x = torch.full((2, 64), 0.5)
    exact = x @ (q.float() * head.weight_q.scale.float()[:, None]).t()
    assert exact.argmax(-1).tolist() == [5, 5]
    served = head(x)
    assert served.argmax(-1).tolist() == [5, 5]
    top = exact.topk(Q.QuantHead.RESCORED, -1).indices
    assert torch.allclose(served.gather(-1, top), exact.gather(-1, top), rtol=0, atol=1e-5)
    head.RESCORED = 0  # what the kernel alone returns: a tie
    plain = head(x)
    assert torch.equal(plain[:, 3], plain[:, 5]) and plain.argmax(-1).tolist() == [3, 3]
