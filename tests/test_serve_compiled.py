"""The compiled engine step (serve/compiled.py): same tokens as the eager engine, graphs built by warm_up and
reused after it, quantized weights through the same ops, and a clear error where it cannot run."""

import copy

import pytest
import torch
from conftest import GEMMA_LIKE, TINY, arrive_one_per_step, full_depth_greedy
from torch._dynamo.utils import counters

from looplm.convert import convert
from looplm.errors import UsageError
from looplm.models import LoopLMConfig, LoopLMForCausalLM, add_exit_adapters
from looplm.models import quantized as Q
from looplm.serve import Engine, Request, make_scheduler, warm_up
from looplm.serve import compiled as C
from looplm.serve.exits import ExitPolicy
from looplm.serve.schedulers import replay

pytestmark = pytest.mark.skipif(
    not any(__import__("shutil").which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile on CPU needs a C++ compiler",
)


def _relaxed():
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**TINY)).eval()
    return convert(vanilla, loops=2, init="stepwise", lora_ranks=8, norms="per-depth").eval()


def _gemma_like():
    """Sliding-window and full layers (window 4, shorter than the prompts), post-norms and q/k norms."""
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(
        LoopLMConfig(
            **TINY,
            **GEMMA_LIKE,
        )
    ).eval()
    return convert(vanilla, loops=2, init="average", lora_ranks=8, norms="per-depth").eval()


def _prefixed():
    """Per-depth prefixes (appendix G): P entries in front of every cache row."""
    torch.manual_seed(0)
    model = LoopLMForCausalLM(
        LoopLMConfig(**TINY, num_loops=2, lora_ranks={"q": 2, "kv": 2, "out": 2, "ffn": 2}, prefix_length=3)
    ).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.prefix.normal_(std=1.0)
    return model


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in (5, 11, 1, 8)]


def _serve(engine, prompts, n, scheduler):
    reqs = [Request(p, n) for p in prompts]
    arrive_one_per_step(make_scheduler(scheduler, engine), reqs)
    return [r.output for r in reqs]


# The quantized ops take bfloat16 activations: a graph fuses the float work around them (norms, LoRA, attention)
# and rounds it differently from the eager ops, moving a logit by a bfloat16 step or two (0.016-0.03 on this model).
# Where the eager engine's two leading logits are closer than that, either token is the greedy one.
TIE = 0.06


def _serve_with_margins(engine, prompts, n):
    """Tokens served by the eager ``engine`` (sequence scheduler), and for every token the gap between the two
    leading logits it was chosen from."""
    reqs = [Request(p, n) for p in prompts]
    margins = {id(r): [] for r in reqs}
    exit_logits = engine._exit_logits

    def recording(h, pairs):
        logits = exit_logits(h, pairs)
        top = logits.float().topk(2, -1).values
        for (item, _), gap in zip(pairs, (top[:, 0] - top[:, 1]).tolist()):
            margins[id(item.req)].append(gap)
        return logits

    engine._exit_logits = recording
    arrive_one_per_step(make_scheduler("sequence", engine), reqs)
    return [r.output for r in reqs], [margins[id(r)] for r in reqs]


def _assert_same_tokens_up_to_ties(got, want, margins):
    """``got`` is ``want`` token for token, except that a sequence may part from it at a token the eager engine
    chose from a tie (and then goes its own way); at most one sequence does."""
    parted = 0
    for g, w, m in zip(got, want, margins):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if first is not None:
            assert m[first] < TIE, f"tokens part at {first} ({g} vs {w}), leading logits {m[first]:.3f} apart"
            parted += 1
        assert len(g) == len(w)
    assert parted <= 1, f"{parted} sequences part from the eager engine's"


def _frames():
    return counters["frames"]["ok"]


def test_compiled_engine_serves_the_eager_engines_tokens_and_compiles_only_in_warm_up():
    model = _relaxed()
    prompts = _prompts()
    want = [full_depth_greedy(model, p, 6) for p in prompts]
    engine = Engine(model, max_batch=3, max_seq_len=64, compile=True)
    assert engine.packed_bytes == 0  # a compiled engine holds no packed copies
    counters.clear()  # graph breaks of earlier tests in this process are not this engine's
    before = _frames()
    assert warm_up(engine) > 0
    compiled = _frames() - before
    assert compiled >= 2  # both regions, before and after attention
    assert engine.stats["stages"] == 0 and engine.cache.free_rows == 3
    for scheduler in ("sequence", "depth"):  # depth: mixed-depth steps run eagerly between compiled ones
        assert _serve(engine, prompts, 6, scheduler) == want
    assert _frames() - before == compiled, "serving after warm_up compiled again"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_engine_serves_a_middle_cycle_model_with_a_loop_scale_and_magnitudes():
    """Mixture-of-Recursions' relaxations run inside the compiled regions (the loop scale after the block, the
    magnitude in each linear): the same tokens as the eager forward, prelude and coda included."""
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**{**TINY, "num_hidden_layers": 6})).eval()
    model = convert(vanilla, loops=2, strategy="middle-cycle", lora_ranks=4, loop_scale=True, magnitude=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("loop_scale.weight", "magnitude")):
                p.uniform_(0.5, 1.5)
    prompts = _prompts()
    want = [full_depth_greedy(model, p, 6) for p in prompts]
    engine = Engine(model, max_batch=3, max_seq_len=64, compile=True)
    warm_up(engine)
    assert _serve(engine, prompts, 6, "sequence") == want


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


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(
            f,
            marks=pytest.mark.skipif(
                f not in Q.supported_formats("cpu"), reason=f"this torch build lacks the {f} CPU op"
            ),
        )
        for f in ("int8", "int4")
    ],
)
@pytest.mark.parametrize("lora", ["shared", "merged"])
def test_compiled_engine_on_quantized_weights_serves_the_eager_engines_tokens(fmt, lora):
    """Shared weights with the LoRA on top, or one merged weight per depth: the compiled engine (regional
    graphs, and the whole-loop graph at batch 1, where int8 products are the streamed reduction; a prompt of
    ``DENSE_ROWS`` tokens or more, where they are dense) serves the eager engine's tokens (up to bfloat16 ties) and
    compiles nothing after warm-up. At batch 1 the LM head (int8 under both formats) runs in a graph of its own."""
    qm = Q.quantize_model(copy.deepcopy(_relaxed()), fmt, lora=lora)
    g = torch.Generator().manual_seed(2)
    prompts = _prompts() + [torch.randint(0, 256, (Q.DENSE_ROWS + 3,), generator=g).tolist()]
    for rows, batch in ((3, prompts), (1, prompts[:1] + prompts[-1:])):
        want, margins = _serve_with_margins(Engine(qm, max_batch=rows, max_seq_len=64), batch, 5)
        engine = Engine(qm, max_batch=rows, max_seq_len=64, compile=True)
        warm_up(engine)
        before = _frames()
        heads, inner = [], engine.compiled.exit_logits
        engine.compiled.exit_logits = lambda *a: heads.append(a[1].shape[0]) or inner(*a)
        _assert_same_tokens_up_to_ties(_serve(engine, batch, 5, "sequence"), want, margins)
        assert _frames() == before, "serving after warm_up compiled again"
        if rows == 1:
            assert heads == [1] * 5 * len(batch)  # every token's head in the compiled graph


@pytest.mark.parametrize(
    "rows,make,lengths",
    [
        (1, _relaxed, (5,)),
        (1, _relaxed, (1,)),
        (3, _relaxed, (5, 11, 1)),
        (3, _gemma_like, (5, 11, 1)),
        (2, _prefixed, (5, 1)),
    ],
)
def test_a_decode_step_with_every_row_busy_runs_each_loop_as_one_compiled_call(rows, make, lengths):
    """Batch 1, or one request per cache row at one loop: the whole-loop graph (cache writes and in-place
    reads inside) gives the eager engine's tokens and writes the same keys and values into the engine's own
    cache tensors; a one-token prompt compiles nothing after warm-up either."""
    model = make()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    eager = Engine(model, max_batch=rows, max_seq_len=64)
    engine = Engine(model, max_batch=rows, max_seq_len=64, compile=True)
    warm_up(engine)
    before = _frames()
    calls = []
    run = engine.compiled.decode_loop
    engine.compiled.decode_loop = lambda *a: calls.append(1) or run(*a)
    outputs, rows_of = [], []
    for e in (eager, engine):
        reqs = [Request(p, 6, full_depth=True) for p in prompts]
        row = {}
        start = e.start
        e.start = lambda req, start=start, row=row: (start(req), row.setdefault(id(req), req.row))[0]
        replay(make_scheduler("sequence", e), reqs)
        outputs.append([r.output for r in reqs])
        rows_of.append([row[id(r)] for r in reqs])  # the cache row each request held
    assert outputs[0] == outputs[1] == [full_depth_greedy(model, p, 6) for p in prompts]
    assert len(calls) == 2 * 5  # two loops for each of the five decoded tokens
    assert _frames() == before, "serving after warm_up compiled again"
    R, L = rows, model.config.num_hidden_layers
    for i, p in enumerate(prompts):  # positions 0 .. len(p) + 4 of the request's row were written
        n = model.config.prefix_length + len(p) + 5
        for name in ("k", "v"):
            got = getattr(engine.cache, name)[[d * R + rows_of[1][i] for d in range(L)]]
            want = getattr(eager.cache, name)[[d * R + rows_of[0][i] for d in range(L)]]
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "rows,make,lengths", [(1, _relaxed, (5,)), (3, _relaxed, (5, 11, 1)), (3, _gemma_like, (5, 11, 1))]
)
def test_the_kv_fill_of_exited_tokens_is_one_compiled_call_that_writes_the_eager_entries(rows, make, lengths):
    """kv mode copy: every decoded token leaves after loop 1 (softmax threshold 0), so each decode step fills
    the skipped depths' cache entries, one compiled call per exit (one token, or several in one step). The
    compiled engine emits the eager engine's tokens and writes the same keys and values, and compiles nothing
    after warm-up. Gemma-like: sliding-window and full depths, each with its own rotary table."""
    model = make()
    policy = ExitPolicy("softmax", 0.0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    eager = Engine(model, max_batch=rows, max_seq_len=64, exit_policy=policy)
    engine = Engine(model, max_batch=rows, max_seq_len=64, exit_policy=policy, compile=True)
    warm_up(engine)
    before = _frames()
    calls = []
    run = engine.compiled.fill_kv
    engine.compiled.fill_kv = lambda *a: calls.append(a[4].shape[1]) or run(*a)
    outputs, rows_of = [], []
    for e in (eager, engine):
        reqs = [Request(p, 6) for p in prompts]
        row = {}
        start = e.start
        e.start = lambda req, start=start, row=row: (start(req), row.setdefault(id(req), req.row))[0]
        replay(make_scheduler("depth", e), reqs)
        outputs.append([r.output for r in reqs])
        rows_of.append([row[id(r)] for r in reqs])
        assert all(r.exit_loops[1:] == [1] * 5 for r in reqs)  # the first token comes from the prompt: full depth
    assert outputs[0] == outputs[1]
    assert sum(calls) == 5 * len(prompts) and (rows == 1 or max(calls) > 1)
    assert _frames() == before, "serving after warm_up compiled again"
    R, L = rows, model.config.num_hidden_layers
    for i, p in enumerate(prompts):
        n = len(p) + 5
        for name in ("k", "v"):
            got = getattr(engine.cache, name)[[d * R + rows_of[1][i] for d in range(L)]]
            want = getattr(eager.cache, name)[[d * R + rows_of[0][i] for d in range(L)]]
            torch.testing.assert_close(got[:, :, :n], want[:, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("int8" not in Q.supported_formats("cpu"), reason="this torch build lacks the int8 CPU op")
@pytest.mark.parametrize("kind,rank", [("affine", None), ("head-lora", 4)])
def test_a_quantized_batch_1_head_runs_compiled_after_every_loop_with_an_exit_adapter(kind, rank):
    """int8 weights at batch 1: the head of every emitted token, after loop 1 (through the model's exit adapter)
    and after the last loop, is one compiled call, with the eager engine's tokens and nothing compiled after
    warm-up (the adapter's per-loop choice is data-dependent on a loop tensor, so the row's loop enters as an int)."""
    model = _relaxed()
    add_exit_adapters(model, kind, rank)
    with torch.no_grad():
        for p in model.exit_adapter.parameters():
            p.normal_(std=0.3)
    qm = Q.quantize_model(model, "int8")
    policy = ExitPolicy("margin", 0.02)
    prompts = _prompts()[:2]
    want = _serve(Engine(qm, max_batch=1, max_seq_len=64, exit_policy=policy), prompts, 6, "depth")
    engine = Engine(qm, max_batch=1, max_seq_len=64, exit_policy=policy, compile=True)
    warm_up(engine)
    before = _frames()
    heads, inner = [], engine.compiled.exit_logits
    engine.compiled.exit_logits = lambda *a: heads.append(a[2]) or inner(*a)
    reqs = [Request(p, 6) for p in prompts]
    arrive_one_per_step(make_scheduler("depth", engine), reqs)
    assert [r.output for r in reqs] == want
    assert {1, 2} <= {l for r in reqs for l in r.exit_loops}  # tokens left after loop 1 and after loop 2
    assert len(heads) >= 12 and set(heads) == {0, 1}  # margin: a token that stays had its loop-1 head read too
    assert _frames() == before, "serving after warm_up compiled again"


def test_engines_on_other_weights_in_one_process_never_share_a_whole_loop_graph():
    """The whole-loop graphs run without guards on the modules they read; each engine compiles its own copy
    of the function, so a float engine and an int4 engine of one architecture, served in turns, each keep
    their eager engine's tokens (one shared graph would run one engine's code on the other's modules)."""
    model = _relaxed()
    qm = Q.quantize_model(copy.deepcopy(model), "int4")
    prompts = [[7, 3, 9, 1, 4]]
    want = [_serve(Engine(m, max_batch=1, max_seq_len=64), prompts, 5, "sequence") for m in (model, qm)]
    engines = [Engine(m, max_batch=1, max_seq_len=64, compile=True) for m in (model, qm)]
    assert want[0] != want[1]  # int4 weights change this small model's tokens, so a mix-up would show
    for _ in range(2):
        assert [_serve(e, prompts, 5, "sequence") for e in engines] == want


def test_compile_without_a_cpp_compiler_is_a_usage_error(monkeypatch):
    from looplm import util

    monkeypatch.setattr(util.shutil, "which", lambda name: None)
    with pytest.raises(UsageError, match="C\\+\\+ compiler"):
        Engine(_relaxed(), max_batch=2, max_seq_len=32, compile=True)
