"""Prefix-tuning relaxation (paper appendix G): per-depth learned prefixes whose keys and values every
query attends to. Checked against attention written out by hand, through transformers' generate()
with a cache, left padding and sliding windows, saving, unrolling, parameter counts (the paper's table),
training and the serving engine."""

import copy
import json
import math

import pytest
import torch
from conftest import GEMMA_LIKE, arrive_one_per_step, full_depth_greedy, run_cli
from conftest import TINY as CONFTEST_TINY

from looplm.convert import convert, count_parameters, unroll
from looplm.models import ConfigError, LoopLMConfig, LoopLMForCausalLM, load_checkpoint, save_checkpoint
from looplm.serve import Engine, ExitPolicy, Request, make_scheduler
from looplm.serve.batch import DepthRunner

TINY = dict(CONFTEST_TINY, vocab_size=97, hidden_size=32, intermediate_size=48)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return LoopLMForCausalLM(LoopLMConfig(**{**TINY, **kw})).eval()


def _prefixed(prefix_length=3, **kw):
    """A looped, LoRA-relaxed model with per-depth prefixes large enough to matter."""
    model = _model(num_loops=2, lora_ranks={"q": 2, "kv": 2, "out": 2, "ffn": 2}, prefix_length=prefix_length, **kw)
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.prefix.normal_(std=1.0)
            for name, p in block.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
    return model


def _ids(n, length, seed=1):
    return torch.randint(0, TINY["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


# --- the model ---------------------------------------------------------------------------------------


def test_zero_length_is_the_model_without_prefixes():
    vanilla = _model()
    plain, zero = convert(vanilla, loops=2, lora_ranks=2), convert(vanilla, loops=2, lora_ranks=2, prefix_length=0)
    assert zero.config.prefix_length == 0 and all(b.attn.prefix is None for b in zero.model.layers)
    assert plain.state_dict().keys() == zero.state_dict().keys()
    ids = _ids(2, 9)
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, zero(ids).logits)


def _reference_logits(model, ids):
    """The Llama-style forward written out: at each depth the prefix vectors go through that depth's
    k/v projections (shared weight + its LoRA), get no rotation, and are seen by every query; the
    tokens attend causally among themselves."""
    c, m = model.config, model.model
    b, T = ids.shape
    H, KV, d, P = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.prefix_length
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.arange(T).double()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rot(x):  # [b, T, heads, d]
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps)

    def lin(layer, x, s):
        return x @ (layer.weight + layer.lora_B[s] @ layer.lora_A[s]).double().T

    allowed = torch.cat([torch.ones(T, P, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()], 1)
    h = m.embed_tokens.weight.double()[ids]
    for depth in range(c.num_hidden_layers):
        blk, s = m.layers[c.layer_map[depth]], c.slot_map[depth]
        a = blk.attn
        x = rms(h, blk.attn_norm.weight[0].double())
        q = rot(lin(a.q_proj, x, s).view(b, T, H, d))
        k = rot(lin(a.k_proj, x, s).view(b, T, KV, d))
        v = lin(a.v_proj, x, s).view(b, T, KV, d)
        pre = a.prefix[s].double()
        keys = torch.cat([lin(a.k_proj, pre, s).view(1, P, KV, d).expand(b, -1, -1, -1), k], 1)
        values = torch.cat([lin(a.v_proj, pre, s).view(1, P, KV, d).expand(b, -1, -1, -1), v], 1)
        heads = []
        for i in range(H):
            g = i // (H // KV)
            scores = torch.einsum("btd,bsd->bts", q[:, :, i], keys[:, :, g]) / math.sqrt(d)
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ values[:, :, g])
        h = h + lin(a.o_proj, torch.cat(heads, -1), s)
        x = rms(h, blk.mlp_norm.weight[0].double())
        mlp = blk.mlp
        h = h + lin(mlp.down_proj, torch.nn.functional.silu(lin(mlp.gate_proj, x, s)) * lin(mlp.up_proj, x, s), s)
    return rms(h, m.norm.weight[0].double()) @ model.lm_head.weight.double().T


def test_prefix_attention_equals_a_reference_written_by_hand():
    model = _prefixed(prefix_length=3)
    ids = _ids(2, 7)
    with torch.no_grad():
        got = model(ids).logits.double()
        want = _reference_logits(model, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the prefixes matter: without them (same weights) the logits are far from the reference
        for block in model.model.layers:
            block.attn.prefix.zero_()
        assert (model(ids).logits.double() - want).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["llama", "gemma-sliding"])
def test_prefix_keys_are_unrotated_token_keys(kind):
    """A prefix vector's key and value are those of a token whose attention input is that vector (k/v
    projection, LoRA, bias, Gemma 3's k-norm) at rotation angle zero."""
    model = _prefixed(**(GEMMA_LIKE if kind != "llama" else {}))
    attn, c = model.model.layers[1].attn, model.config
    with torch.no_grad():
        for slot in range(2):
            x = attn.prefix[slot][None]
            cos, sin = torch.ones(1, x.shape[1], c.head_dim), torch.zeros(1, x.shape[1], c.head_dim)
            _, k, v = attn.project(x, slot, cos, sin)
            pk, pv = attn.prefix_kv(slot)
            assert torch.equal(pk, k) and torch.equal(pv, v)


@pytest.mark.parametrize("kind", ["llama", "gemma-sliding"])
def test_generate_with_cache_and_left_padding_equals_full_forward_argmax(kind):
    """transformers' generate() through our DynamicCache path; prompts longer than the sliding window
    (4) and generations past it; a left-padded batch gives each row's unpadded tokens."""
    model = _prefixed(**(GEMMA_LIKE if kind != "llama" else {}))
    short, long = _ids(1, 5, seed=2)[0].tolist(), _ids(1, 9, seed=3)[0].tolist()
    want = [full_depth_greedy(model, p, 8) for p in (short, long)]
    assert want[0] != want[1]
    with torch.no_grad():
        for p, w in zip((short, long), want):
            out = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert out[0, len(p) :].tolist() == w
        pad = len(long) - len(short)
        ids = torch.tensor([[0] * pad + short, long])
        mask = torch.tensor([[0] * pad + [1] * len(short), [1] * len(long)])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert [out[0, len(long) :].tolist(), out[1, len(long) :].tolist()] == want


def test_save_load_and_unroll_keep_the_prefixes(tmp_path):
    from transformers import AutoModelForCausalLM

    import looplm  # noqa: F401  (registers looplm with the Auto classes)

    model = _prefixed()
    ids = _ids(2, 6)
    save_checkpoint(model, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m")
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(loaded(ids).logits, want)
        # from_pretrained leaves tensors at 24 bytes past a 64-byte boundary, and BLAS rounds by alignment
        torch.testing.assert_close(auto(ids).logits, want, atol=1e-5, rtol=1e-5)
        dense = unroll(model)
        assert dense.config.num_loops == 1 and dense.config.prefix_length == 3
        torch.testing.assert_close(dense(ids).logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_prefix_keys_take_one_stacked_matmul(fmt):
    """With q|k|v stacked into one quantized weight, a depth's prefix keys and values come from one call of
    the stacked matmul (not one full q|k|v product each for k and v) and equal the separate weights' ones."""
    from looplm.models.quantized import quantize_model, supported_formats

    if fmt not in supported_formats("cpu"):
        pytest.skip(f"this torch build cannot run {fmt} weights on CPU")
    model = _prefixed(hidden_size=64, intermediate_size=128)  # int4 groups of 32 divide every width
    fused = quantize_model(copy.deepcopy(model), fmt, act_dtype=torch.float32)
    plain = quantize_model(copy.deepcopy(model), fmt, act_dtype=torch.float32, fuse=False)
    attn, ref = fused.model.layers[0].attn, plain.model.layers[0].attn
    calls = []
    stacked_linear = attn.qkv.linear
    attn.qkv.linear = lambda x, *a, **kw: calls.append(x.shape) or stacked_linear(x, *a, **kw)
    with torch.no_grad():
        for slot in range(2):
            (k, v), (k_ref, v_ref) = attn.prefix_kv(slot), ref.prefix_kv(slot)
            assert torch.allclose(k, k_ref, atol=1e-5) and torch.allclose(v, v_ref, atol=1e-5)
    assert calls == [torch.Size([1, 3, 64])] * 2  # one stacked call per depth


# --- conversion and counts -----------------------------------------------------------------------------


def test_convert_adds_small_random_prefixes_and_they_count_in_n_emb():
    vanilla = _model()
    rec = convert(vanilla, loops=2, lora_ranks=0)
    pre = convert(vanilla, loops=2, lora_ranks=0, prefix_length=5)
    L, D = TINY["num_hidden_layers"], TINY["hidden_size"]
    assert [tuple(b.attn.prefix.shape) for b in pre.model.layers] == [(2, 5, D)] * 2  # [B, P, hidden] per shared layer
    counts, base = count_parameters(pre), count_parameters(rec)
    assert counts["prefix"] == L * 5 * D and base["prefix"] == 0
    assert counts["n_emb"] - base["n_emb"] == L * 5 * D and counts["embedding"] == base["embedding"]
    std = torch.cat([b.attn.prefix.flatten() for b in pre.model.layers]).std()
    assert 0.5 * TINY["initializer_range"] < std < 2 * TINY["initializer_range"]
    assert pre.config.conversion["prefix_length"] == 5
    with torch.no_grad():  # shared weights as in the rank-0 conversion; the prefixes change the output
        assert torch.equal(pre.model.layers[0].attn.q_proj.weight, rec.model.layers[0].attn.q_proj.weight)
        assert not torch.allclose(pre(_ids(1, 6)).logits, rec(_ids(1, 6)).logits)


@pytest.mark.parametrize(
    "family,layers,hidden,sizes",
    [
        ("gemma", 18, 2048, {256: 9.4, 512: 18.9, 1024: 37.7, 2048: 75.5}),
        ("tinyllama", 22, 2048, {256: 11.5, 512: 23.1, 1024: 46.1, 2048: 92.3}),
    ],
)
def test_prefix_sizes_are_the_papers(family, layers, hidden, sizes):
    """Table tab:prefix_tuning_app, 'Size' column: B = 2 Gemma 2B and TinyLlama 1.1B (built on the meta
    device: shapes only). One hidden-size vector per prefix position per depth."""
    for P, millions in sizes.items():
        with torch.device("meta"):
            model = LoopLMForCausalLM(
                LoopLMConfig(
                    vocab_size=8,
                    hidden_size=hidden,
                    intermediate_size=8,
                    num_hidden_layers=layers,
                    num_attention_heads=8,
                    num_key_value_heads=1,
                    head_dim=256,
                    num_loops=2,
                    prefix_length=P,
                )
            )
        assert round(count_parameters(model)["prefix"] / 1e6, 1) == millions


def test_bad_prefix_length():
    with pytest.raises(ConfigError, match="prefix_length"):
        LoopLMConfig(**TINY, prefix_length=-1)
    with pytest.raises(ConfigError, match="prefix length"):
        convert(_model(), loops=2, prefix_length=-2)
    with pytest.raises(ConfigError, match="without prefixes"):
        convert(_model(prefix_length=2), loops=2)


# --- training ------------------------------------------------------------------------------------------


def test_prefixes_train_without_weight_decay():
    from looplm.train.loop import param_groups, select_trainable

    model = _prefixed().train()
    prefixes = {id(b.attn.prefix) for b in model.model.layers}
    decay, no_decay = param_groups(model, 0.1)
    assert prefixes <= {id(p) for p in no_decay["params"]} and not prefixes & {id(p) for p in decay["params"]}
    n = select_trainable(model, "prefix")
    assert n == count_parameters(model)["prefix"]
    assert {id(p) for p in model.parameters() if p.requires_grad} == prefixes
    ids = _ids(2, 8)
    model(ids, labels=ids).loss.backward()
    assert all(b.attn.prefix.grad.abs().sum() > 0 for b in model.model.layers)


# --- serving -------------------------------------------------------------------------------------------


def _serve(model, ps, lens, scheduler, **engine_kw):
    """Requests arrive one per step (deterministic mid-flight arrivals, so depth-wise steps mix loops)."""
    engine = Engine(model, max_batch=3, max_seq_len=48, **engine_kw)
    sched = make_scheduler(scheduler, engine)
    reqs = [Request(p, n) for p, n in zip(ps, lens)]
    arrive_one_per_step(sched, reqs)
    return engine, reqs


PROMPTS = [_ids(1, n, seed=10 + n)[0].tolist() for n in (5, 11, 1, 9, 3)]
LENS = [7, 3, 9, 5, 6]


@pytest.mark.parametrize("kind", ["llama", "gemma-sliding"])
@pytest.mark.parametrize("scheduler", ["static", "sequence", "depth"])
@pytest.mark.parametrize("in_place", [0.0, 2.0])
def test_engine_equals_full_depth_greedy(kind, scheduler, in_place, monkeypatch):
    """The engine keeps each depth's prefix keys/values at the front of every cache row; decode attention
    read in place (fraction 0) or gathered (2), prompt segments, mixed-loop steps: all exact."""
    monkeypatch.setattr(DepthRunner, "in_place_min_fraction", in_place)
    model = _prefixed(**(GEMMA_LIKE if kind != "llama" else {}))
    want = [full_depth_greedy(model, p, n) for p, n in zip(PROMPTS, LENS)]
    engine, reqs = _serve(model, PROMPTS, LENS, scheduler)
    assert [r.output for r in reqs] == want
    if scheduler == "depth":
        assert engine.stats["mixed_stages"] > 0


@pytest.mark.parametrize("kv_mode", ["copy", "later"])
def test_engine_early_exits_with_prefixes(kv_mode):
    """Every token exits after loop 1. 'later' fills the skipped loops' KV exactly, so its tokens are the
    loop-1 exits of a teacher-forced full-depth forward; 'copy' runs the CALM path."""
    model = _prefixed()
    engine, reqs = _serve(model, PROMPTS, [6] * 5, "depth", exit_policy=ExitPolicy("softmax", 0.0), kv_mode=kv_mode)
    assert all(r.status == "done" and len(r.output) == 6 for r in reqs)
    if kv_mode == "copy":
        assert engine.stats["kv_copy_tokens"] > 0
        return
    with torch.no_grad():
        for p, r in zip(PROMPTS, reqs):
            _, states, _ = model.model(torch.tensor([p + r.output]), output_loop_states=True)
            exit1 = model.exit_logits(states[0])[0, len(p) : -1].argmax(-1).tolist()
            assert r.output[1:] == exit1[: len(r.output) - 1]


# --- the command ---------------------------------------------------------------------------------------


@pytest.mark.real
def test_cli_convert_prefix_info_and_generate(hf_dir, tmp_path):
    out = tmp_path / "prefix"
    result = json.loads(
        run_cli(
            "convert",
            hf_dir,
            "--relax",
            "prefix",
            "--prefix-length",
            "4",
            "--out",
            out,
            "--scored-tokens",
            "0",
            "--json",
        ).stdout
    )
    L, D = 4, 64  # conftest.SMALL
    assert result["prefix_length"] == 4 and result["prefix_params"] == L * 4 * D
    assert result["lora_ranks"] == {"q": 0, "kv": 0, "out": 0, "ffn": 0}  # --relax prefix: no LoRA unless asked
    info = json.loads(run_cli("info", out, "--json").stdout)
    assert info["prefix_length"] == 4 and info["prefix"] == L * 4 * D and info["n_emb"] == result["n_emb_after"]
    assert "prefixes 1,024" in run_cli("info", out).stdout
    both = json.loads(
        run_cli(
            "convert",
            hf_dir,
            "--relax",
            "prefix",
            "--lora-rank",
            "2",
            "--out",
            tmp_path / "both",
            "--scored-tokens",
            "0",
            "--json",
        ).stdout
    )
    assert both["prefix_length"] == 64 and both["lora_ranks"]["q"] == 2
    text = run_cli("generate", out, "Once upon a time", "--max-new-tokens", "4").stdout
    assert text.strip()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--relax", "prefix", "--prefix-length", "-1"], "--prefix-length must be >= 0"),
        (["--relax", "prefix", "--prefix-length", "0"], "must be >= 1 with --relax prefix"),
        (["--prefix-length", "8"], "--prefix-length needs --relax prefix"),
    ],
)
@pytest.mark.real
def test_cli_bad_prefix_input(hf_dir, tmp_path, args, message):
    out = tmp_path / "never"
    proc = run_cli("convert", hf_dir, "--out", out, "--scored-tokens", "0", *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
