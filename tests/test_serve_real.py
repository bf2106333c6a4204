"""The engine on real SmolLM2 weights: against transformers (B = 1), and a looped conversion (B = 2) against its
own full-depth greedy decoding; greedy outputs are identical."""

import pytest
import torch
from conftest import arrive_one_per_step, full_depth_greedy

from looplm.convert import convert
from looplm.serve import Engine, Request, make_scheduler, replay

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm2():
    from looplm.models import load_hf_reference, load_model

    model, tok = load_model("smollm2-135m")
    hf, _ = load_hf_reference("smollm2-135m")
    return model.eval(), tok, hf.eval()


def test_b1_engine_greedy_equals_transformers_generate(smollm2):
    model, tok, hf = smollm2
    texts = ["The capital of France is", "Satan, with his crew of angels, spoke of"]
    n = 12
    want = []
    with torch.no_grad():
        for t in texts:
            ids = tok(t, return_tensors="pt")["input_ids"]
            g = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            want.append(g[0, ids.shape[1] :].tolist())
    for scheduler in ("sequence", "depth"):
        engine = Engine(model, max_batch=2, max_seq_len=64)
        reqs = [Request(tok(t)["input_ids"], n) for t in texts]
        replay(make_scheduler(scheduler, engine), reqs)
        assert [r.output for r in reqs] == want, scheduler


def test_looped_smollm2_through_the_depth_engine_equals_its_full_depth_greedy(smollm2):
    """SmolLM2 converted on the fly (B=2: 15 shared layers run twice, rank-8 SVD LoRA per depth), served by the
    depth-wise engine without exits: every greedy token equals the looped model's own full-depth greedy decoding
    (its forward over the whole sequence for every token: no cache, no engine). Requests arrive one per step, so
    steps mix loops, and with them the LoRA slots of real weights."""
    model, tok, _ = smollm2
    looped = convert(model, loops=2, init="stepwise", lora_ranks=8).eval()
    texts = ["The capital of France is", "Satan, with his crew of angels, spoke of", "def fibonacci(n):"]
    prompts, n = [tok(t)["input_ids"] for t in texts], 16
    want = [full_depth_greedy(looped, p, n) for p in prompts]  # before the engine packs the weights
    engine = Engine(looped, max_batch=3, max_seq_len=64)
    reqs = [Request(p, n) for p in prompts]
    arrive_one_per_step(make_scheduler("depth", engine), reqs)
    assert engine.stats["mixed_stages"] > 0
    assert all(r.status == "done" and r.exit_loops == [2] * n for r in reqs)
    assert [r.output for r in reqs] == want
