"""`looplm export-gguf`: a looped model (B=2, LoRA, per-depth norms) written as an unrolled llama GGUF file
reads back with the `gguf` package and with transformers' GGUF loader, and gives looplm's own logits
(and llama.cpp's, where llama-cpp-python is installed)."""

import numpy as np
import pytest
import torch
from conftest import TINY, needs_wheel

from looplm.commands import main
from looplm.convert import convert, unroll
from looplm.convert.gguf_export import export_gguf, permute_rotary
from looplm.errors import UsageError
from looplm.models import LoopLMConfig, LoopLMForCausalLM, save_model


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained on a line of text: real merges, a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "looped models, unrolled"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def looped(tmp_path_factory):
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**{**TINY, "vocab_size": len(tok)})).eval()
    model = convert(vanilla, loops=2, init="stepwise", lora_ranks=8, norms="per-depth").eval()
    d = save_model(model, tok, tmp_path_factory.mktemp("m") / "looped")
    return model, tok, d


def test_permutation_matches_llama_cpps_converter():
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written out in numpy
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    want = w.reshape(8, 2, 8, 3).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(permute_rotary(torch.from_numpy(w), 8).numpy(), want)


def test_export_reads_back_and_gives_looplms_logits(looped, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM

    model, tok, d = looped
    out = tmp_path / "looped.gguf"
    assert main(["export-gguf", str(d), "--out", str(out)]) == 0
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 4  # K=2 shared layers x B=2 loops, unrolled
    assert r.fields["tokenizer.ggml.tokens"].contents() == [tok.convert_ids_to_tokens(i) for i in range(len(tok))]
    dense = unroll(model)
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in r.tensors}
    # depth 3 runs shared layer 1 with LoRA slot 1: its merged q weight, permuted for GGUF
    assert torch.equal(tensors["blk.3.attn_q.weight"], permute_rotary(dense.model.layers[3].attn.q_proj.weight, 4))
    assert torch.equal(tensors["blk.3.ffn_down.weight"], dense.model.layers[3].mlp.down_proj.weight)

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    ids = torch.randint(0, len(tok), (2, 12))
    with torch.no_grad():
        want, got = model(ids).logits, hf(ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_quantized_export_stays_within_q8_0_rounding(looped, tmp_path):
    import gguf
    from gguf.quants import dequantize

    model, tok, _ = looped
    out = tmp_path / "q8.gguf"
    export_gguf(model, tok, out, "q8_0")
    r = gguf.GGUFReader(str(out))
    t = next(t for t in r.tensors if t.name == "blk.2.ffn_up.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    w = unroll(model).model.layers[2].mlp.up_proj.weight.detach().numpy()
    back = dequantize(np.array(t.data), t.tensor_type).reshape(w.shape)
    step = np.abs(w.reshape(-1, 32)).max(1, keepdims=True) / 127  # Q8_0: one scale per 32 weights
    # half a step, plus the scale's own float16 rounding (2^-11 relative) times up to 127 steps
    assert (np.abs(back - w).reshape(-1, 32) <= step * (0.5 + 127 / 2048)).all()
    assert np.abs(back - w).max() > 0


def test_refuses_what_llama_cpp_cannot_run(looped, tmp_path):
    _, tok, _ = looped
    gemma = LoopLMForCausalLM(
        LoopLMConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            norm_type="rms_plus1",
            sandwich_norms=True,
            family="gemma3",
        )
    )
    with pytest.raises(UsageError, match="llama-architecture"):
        export_gguf(gemma, tok, tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()
    assert main(["export-gguf", str(tmp_path / "missing"), "--out", str(tmp_path / "x.gguf")]) == 2


def test_llama_cpp_runs_the_export_with_looplms_logits(looped, tmp_path):
    needs_wheel("llama-cpp-python")
    import llama_cpp

    model, tok, _ = looped
    out = tmp_path / "looped.gguf"
    export_gguf(model, tok, out, "f32")
    # float32 KV cache (llama.cpp keeps float16 by default, about 1e-2 off on these logits)
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=1, logits_all=True, verbose=False, type_k=0, type_v=0)
    ids = torch.randint(0, len(tok), (12,)).tolist()
    llm.eval(ids)
    got = torch.tensor(np.array(llm.scores[: len(ids)]))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
