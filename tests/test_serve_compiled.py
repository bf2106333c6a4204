"""The compiled engine step (serve/compiled.py): same tokens as the eager engine, graphs built by warm_up and
reused after it, quantized weights through the same ops, and a clear error where it cannot run."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from looplm.convert import convert
from looplm.errors import UsageError
from looplm.models import LoopLMConfig, LoopLMForCausalLM
from looplm.models import quantized as Q
from looplm.serve import Engine, Request, make_scheduler, warm_up
from looplm.serve import compiled as C
from conftest import arrive_one_per_step, full_depth_greedy

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2)
pytestmark = pytest.mark.skipif(not any(__import__("shutil").which(c) for c in ("g++", "c++", "clang++")),
                                reason="torch.compile on CPU needs a C++ compiler")


def _relaxed():
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**SMALL)).eval()
    return convert(vanilla, loops=2, init="stepwise", lora_ranks=8, norms="per-depth").eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in (5, 11, 1, 8)]


def _serve(engine, prompts, n, scheduler):
    reqs = [Request(p, n) for p in prompts]
    arrive_one_per_step(make_scheduler(scheduler, engine), reqs)
    return [r.output for r in reqs]


def _frames():
    return counters["frames"]["ok"]


def test_compiled_engine_serves_the_eager_engines_tokens_and_compiles_only_in_warm_up():
    model = _relaxed()
    prompts = _prompts()
    want = [full_depth_greedy(model, p, 6) for p in prompts]
    engine = Engine(model, max_batch=3, max_seq_len=64, compile=True)
    assert engine.packed_bytes == 0  # a compiled engine holds no packed copies
    before = _frames()
    assert warm_up(engine) > 0
    compiled = _frames() - before
    assert compiled >= 2  # both regions, before and after attention
    assert engine.stats["stages"] == 0 and engine.cache.free_rows == 3
    for scheduler in ("sequence", "depth"):  # depth: mixed-depth steps run eagerly between compiled ones
        assert _serve(engine, prompts, 6, scheduler) == want
    assert _frames() - before == compiled, "serving after warm_up compiled again"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_regions_match_the_eager_layer_outputs():
    model = _relaxed()
    layer = model.model.layers[0]
    block = C.CompiledBlock("cpu")
    h = torch.randn(1, 3, 64)
    cos, sin = model.model.rotary(torch.arange(3)[None], h.dtype)["full"]
    with torch.no_grad():
        for slot in (0, 1):
            def attend(q, k, v, attn):
                return attn.attend(q, k, v, None)
            want = layer.forward_attend(h, slot, cos, sin, attend)
            got = block.forward_attend(layer, h, slot, cos, sin, attend)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("int4" not in Q.supported_formats("cpu"), reason="this torch build lacks the int4 CPU op")
def test_compiled_engine_on_int4_weights_serves_the_eager_engines_tokens():
    qm = Q.quantize_model(copy.deepcopy(_relaxed()), "int4")
    prompts = _prompts()
    want = _serve(Engine(qm, max_batch=3, max_seq_len=64), prompts, 5, "sequence")
    engine = Engine(qm, max_batch=3, max_seq_len=64, compile=True)
    warm_up(engine)
    assert _serve(engine, prompts, 5, "sequence") == want


def test_compile_without_a_cpp_compiler_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    with pytest.raises(UsageError, match="C\\+\\+ compiler"):
        Engine(_relaxed(), max_batch=2, max_seq_len=32, compile=True)
