"""Sharing plans with unique layers (models/plan.py): middle-cycle, middle-sequence, prelude / core x B / coda.

Every plan must map depths to blocks and slots as stated, refuse what does not fit in one line that names the fix,
recover the original exactly at full rank (checked against transformers), exit through the coda, and keep its KV
per depth."""

import pytest
import torch
from conftest import FAMILIES, make_hf_model

from looplm.convert import convert, count_parameters, describe, tied_depths, unroll
from looplm.models import ConfigError, DepthPlan, LoopLMConfig, LoopLMForCausalLM, from_hf_model
from looplm.train.heal.steps import local_visits

# (sharing, prelude, coda): every plan shape the library ships
PLANS = [
    ("cycle", 0, 0),
    ("sequence", 0, 0),
    ("cycle-rev", 0, 0),
    ("middle-cycle", 0, 0),
    ("middle-sequence", 0, 0),
    ("cycle", 2, 1),
    ("cycle-rev", 1, 1),
]


def test_middle_cycle_keeps_the_ends_unique():
    plan = DepthPlan(8, 2, "middle-cycle")
    assert plan.layer_map == [0, 1, 2, 3, 1, 2, 3, 4]
    assert plan.slot_map == [0, 0, 0, 0, 1, 1, 1, 0]
    assert plan.block_slots == [1, 2, 2, 2, 1]
    assert [plan.is_unique(b) for b in range(plan.num_blocks)] == [True, False, False, False, True]
    assert [d.loop for d in plan.depths] == [None, 0, 0, 0, 1, 1, 1, None]
    assert [d.index for d in plan.path(1)] == [0, 1, 2, 3, 7]  # an exit after loop 1 runs the coda
    assert [d.index for d in plan.path()] == list(range(8))
    assert plan.mixable and plan.describe() == "1 + 3 x 2 + 1 (cycle core)"


def test_middle_sequence_and_prelude_coda():
    assert DepthPlan(8, 2, "middle-sequence").layer_map == [0, 1, 1, 2, 2, 3, 3, 4]
    assert not DepthPlan(8, 2, "middle-sequence").mixable
    plan = DepthPlan(10, 2, "cycle", prelude=2, coda=2)
    assert plan.layer_map == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]
    assert plan.num_shared == 3 and plan.shared_blocks == [2, 3, 4]


def test_a_remainder_of_the_core_stays_unique():
    """B = 3 does not divide a core of 16: the 16th core layer joins the coda, unique, so full rank stays exact."""
    plan = DepthPlan(18, 3, "cycle", prelude=1, coda=1)
    assert (plan.prelude_layers, plan.num_shared, plan.coda_layers) == (1, 5, 2)
    assert plan.layer_map[-3:] == [5, 6, 7] and plan.block_slots[-2:] == [1, 1]


def test_old_checkpoints_and_named_plans_load():
    old = {"num_hidden_layers": 4, "num_loops": 2, "sharing": "cycle"}  # a config.json from before plans had ends
    c = LoopLMConfig(**old)
    assert (c.prelude_layers, c.coda_layers, c.layer_map) == (0, 0, [0, 1, 0, 1])
    named = LoopLMConfig(num_hidden_layers=6, num_loops=2, sharing="middle-cycle")
    assert (named.sharing, named.prelude_layers, named.coda_layers) == ("cycle", 1, 1)
    again = LoopLMConfig(**{k: v for k, v in named.to_dict().items() if k != "model_type"})
    assert again.layer_map == named.layer_map == [0, 1, 2, 1, 2, 3]


@pytest.mark.parametrize(
    "args, message",
    [
        ((30, 7), "does not divide"),
        ((30, 7, "cycle", 0, 2), None),  # the remainder joins the coda: fine
        ((6, 2, "cycle", 3, 2), "keep at least 2 in the core"),
        ((6, 2, "cycle", -1, 0), "whole numbers >= 0"),
        ((6, 2, "zigzag"), "unknown sharing"),
    ],
)
def test_plans_that_do_not_fit_are_refused_naming_the_fix(args, message):
    if message is None:
        DepthPlan(*args)
        return
    with pytest.raises(ConfigError, match=message):
        DepthPlan(*args)


def test_a_shared_block_never_mixes_attention_kinds():
    """In a plan with unique layers; the paper's plans keep the kind with the depth, as their checkpoints have."""
    kinds = ["sliding", "full"] * 3
    assert DepthPlan(6, 3, "cycle", depth_attention=kinds).layer_map == [0, 1, 0, 1, 0, 1]
    assert DepthPlan(6, 2, "sequence", depth_attention=kinds).layer_map == [0, 0, 1, 1, 2, 2]
    assert DepthPlan(6, 2, "middle-cycle", depth_attention=kinds).layer_map == [0, 1, 2, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"shared block 1 at depth 1 \(full attention\) and depth 2 \(sliding\)"):
        DepthPlan(6, 2, "middle-sequence", depth_attention=kinds)


def _full_rank(sharing, prelude, coda):
    return dict(
        loops=2, strategy=sharing, init="average", norms="per-depth", lora_ranks="full", lora_init="svd",
        prelude=prelude, coda=coda,
    )  # fmt: skip


def _fits(family, sharing, prelude, coda, layers=6):
    kinds = from_hf_model(make_hf_model(family, num_layers=layers)).config.depth_attention
    try:
        DepthPlan(layers, 2, sharing, prelude, coda, kinds)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sharing, prelude, coda", PLANS[3:])
def test_every_plan_at_full_rank_is_the_original(family, sharing, prelude, coda):
    """Against transformers: unique layers copied exactly, shared ones restored by full-rank LoRA."""
    if not _fits(family, sharing, prelude, coda):
        pytest.skip("this plan mixes the family's attention kinds in a shared block (refused, tested above)")
    hf = make_hf_model(family, num_layers=6)
    vanilla = from_hf_model(hf)
    relaxed = convert(vanilla, **_full_rank(sharing, prelude, coda))
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        ref = hf(ids).logits
        assert (relaxed(ids).logits - ref).abs().max().item() < 1e-4
        assert (unroll(relaxed)(ids).logits - ref).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def vanilla():
    torch.manual_seed(0)
    cfg = LoopLMConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4)
    return LoopLMForCausalLM(cfg).eval()


def test_unique_layers_are_the_originals_with_no_lora(vanilla):
    for init in ("average", "stepwise", "lower", "upper"):
        m = convert(vanilla, loops=2, strategy="cycle", init=init, lora_ranks=8, prelude=2, coda=1)
        plan = m.config.plan
        for b in range(plan.num_blocks):
            block = m.model.layers[b]
            if plan.is_unique(b):
                d = plan.block_depths[b][0]
                src = vanilla.model.layers[d].state_dict()
                assert block.attn.q_proj.lora_A is None and block.mlp.down_proj.lora_A is None
                assert all(torch.equal(v, src[k]) for k, v in block.state_dict().items()), (init, b)
            else:
                assert block.attn.q_proj.lora_A.shape[0] == 2  # one LoRA per depth the block runs


def test_selecting_inits_pick_from_the_core(vanilla):
    """Upper (Mixture-of-Recursions) copies the core's last K layers, Lower its first K, Stepwise keeps its ends."""
    picks = {}
    for init in ("upper", "lower", "stepwise"):
        m = convert(vanilla, loops=2, strategy="middle-cycle", init=init, lora_ranks=0)
        picks[init] = [
            next(
                d
                for d in range(8)
                if torch.equal(m.model.layers[b].attn.q_proj.weight, vanilla.model.layers[d].attn.q_proj.weight)
            )
            for b in m.config.plan.shared_blocks
        ]
    assert picks == {"upper": [4, 5, 6], "lower": [1, 2, 3], "stepwise": [1, 3, 6]}


def test_parameter_counts_follow_the_plan(vanilla):
    per_layer = sum(p.numel() for p in vanilla.model.layers[0].parameters())
    final_norm = vanilla.model.norm.weight.numel()
    for sharing, prelude, coda in PLANS:
        m = convert(vanilla, loops=2, strategy=sharing, init="average", norms="tied-avg", lora_ranks=0,
                    prelude=prelude, coda=coda)  # fmt: skip
        blocks = m.config.plan.num_blocks
        assert count_parameters(m)["n_emb"] == blocks * per_layer + final_norm, sharing
        info = describe(m)
        assert info["unique_layers"] == blocks - m.config.num_shared_layers
        assert len(tied_depths(m.config)) == blocks


def test_the_default_rank_keeps_n_emb_at_cycle_rank_64s(vanilla):
    """equal_nemb_rank: the largest rank whose N-emb is at most the paper's cycle plan's at a reference rank (one
    more rank is over it), for plans with unique ends; cycle itself gets the reference (16 here: this model's
    linears cap a rank at 64)."""
    from looplm.convert import equal_nemb_rank

    def n_emb(sharing, prelude, coda, rank):
        m = convert(vanilla, loops=2, strategy=sharing, lora_ranks=rank, lora_init="zero", norms="per-depth",
                    prelude=prelude, coda=coda)  # fmt: skip
        return count_parameters(m)["n_emb"]

    reference = n_emb("cycle", 0, 0, 16)
    ranks = {}
    for sharing, prelude, coda in [("cycle", 0, 0), ("middle-cycle", 0, 0), ("cycle", 2, 1)]:
        r = ranks[sharing, prelude, coda] = equal_nemb_rank(vanilla, DepthPlan(8, 2, sharing, prelude, coda), 16)
        assert n_emb(sharing, prelude, coda, r) <= reference < n_emb(sharing, prelude, coda, r + 1), sharing
    assert ranks["cycle", 0, 0] == 16 > ranks["middle-cycle", 0, 0] > ranks["cycle", 2, 1]


@pytest.mark.parametrize(
    "attention, loops, layer_map, note",
    [
        (["full"] * 4, 2, [0, 1, 1, 2], False),  # middle-cycle: 1 + 1 x 2 + 1
        (["sliding", "full", "sliding", "full"], 2, [0, 1, 0, 1], True),  # Gemma-like: no middle-cycle keeps kinds
    ],
)
def test_convert_defaults_to_middle_cycle_where_the_attention_pattern_allows(
    tmp_path, capsys, attention, loops, layer_map, note
):
    from conftest import GEMMA_LIKE
    from test_gguf_export import tiny_tokenizer

    from looplm.commands import main
    from looplm.models import save_model

    tok = tiny_tokenizer()
    switches = GEMMA_LIKE if "sliding" in attention else {}
    torch.manual_seed(0)
    cfg = LoopLMConfig(**{**switches, "depth_attention": attention}, vocab_size=len(tok), hidden_size=128,
                       intermediate_size=256, num_hidden_layers=4, num_attention_heads=2)  # fmt: skip
    src = save_model(LoopLMForCausalLM(cfg).eval(), tok, tmp_path / "src")
    out = tmp_path / "looped"
    args = ["convert", str(src), "--loops", str(loops), "--calib-tokens", "64", "--calib-seq-len", "32"]
    assert main([*args, "--scored-tokens", "0", "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    from looplm.models import load_model

    model = load_model(out)[0]
    assert model.config.plan.layer_map == layer_map
    assert ("leaves no middle-cycle plan" in captured.err) == note
    rank = model.config.lora_ranks["q"]
    assert (rank == 64) == note and rank > 0  # cycle keeps rank 64; middle-cycle gives its extra layer back in rank


def _run_original_depths(vanilla, ids, depths):
    h = vanilla.model.embed(ids)
    return vanilla.model.run_depths(h, [vanilla.config.plan.depths[d] for d in depths])


@pytest.mark.parametrize("sharing, prelude, coda", [("middle-cycle", 0, 0), ("cycle", 2, 1), ("middle-sequence", 0, 0)])
def test_an_exit_after_loop_i_runs_the_coda(vanilla, sharing, prelude, coda):
    """At full rank, the exit after loop 1 is the original with the later loops' depths left out, the coda kept."""
    m = convert(vanilla, **_full_rank(sharing, prelude, coda))
    plan = m.config.plan
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        _, states, _ = m.model(ids, output_loop_states=True)
        want = _run_original_depths(vanilla, ids, [d.index for d in plan.path(1)])
        assert (states[0] - want).abs().max().item() < 1e-4
        assert (m(ids, num_loops=1).logits - m.exit_logits(states[0], 0)).abs().max().item() < 1e-4
        assert (states[1] - m.model(ids)[0]).abs().max().item() == 0


def test_kv_is_kept_per_depth_with_a_coda(vanilla):
    """Cached greedy decoding equals the full forward pass at every step, at full depth and at a static exit."""
    m = convert(vanilla, loops=2, strategy="cycle", init="average", lora_ranks=4, prelude=1, coda=2)
    ids = torch.randint(0, 128, (1, 6))
    for loops in (2, 1):
        with torch.no_grad():
            out = m.generate(ids, max_new_tokens=6, do_sample=False, num_loops=loops)
            seq = ids
            for _ in range(6):
                nxt = m(seq, num_loops=loops).logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], 1)
        assert torch.equal(out, seq), loops


def test_healing_spends_no_local_steps_on_unique_layers(vanilla):
    m = convert(vanilla, loops=2, strategy="middle-cycle", lora_ranks=0)
    assert local_visits(m.config, sequential=False) == [1, 2, 3]
    assert local_visits(m.config, sequential=True) == [1, 2, 3, 4, 5, 6]
    assert local_visits(vanilla.config, sequential=False) == list(range(8))  # a reduced-size model: every layer


def _middle_relaxed(vocab_size: int = 256):
    """TINY at 6 layers, middle-cycle (1 + 2 x 2 + 1), rank-8 LoRA and per-depth norms."""
    from conftest import TINY

    torch.manual_seed(0)
    cfg = {**TINY, "num_hidden_layers": 6, "vocab_size": vocab_size}
    vanilla = LoopLMForCausalLM(LoopLMConfig(**cfg)).eval()
    return convert(vanilla, loops=2, strategy="middle-cycle", init="stepwise", lora_ranks=8, norms="per-depth").eval()


@pytest.mark.parametrize("lora", ["shared", "merged"])
def test_quantized_plan_serves_the_dequantized_models_tokens(lora):
    """int8 weights of a plan with unique layers (one per-depth weight for a unique block when merged): the engine's
    greedy tokens, loops mixed in its batches, are those of the float model built from the rounded weights."""
    import copy

    from conftest import arrive_one_per_step, full_depth_greedy
    from test_quantized import FORMATS, dequantized_reference, merged_reference

    from looplm.models import quantized as Q
    from looplm.serve import Engine, Request, make_scheduler

    if "int8" not in FORMATS:
        pytest.skip("this torch build has no int8 weight-only op on CPU")
    model = _middle_relaxed()
    ref = (merged_reference if lora == "merged" else dequantized_reference)(model, "int8")
    qm = Q.quantize_model(copy.deepcopy(model), "int8", act_dtype=torch.float32, lora=lora)
    if lora == "merged":  # a unique block has no LoRA to merge: its one weight; a shared block one per depth
        assert not isinstance(qm.model.layers[0].attn.qkv, Q.PerDepthWeight)
        assert len(qm.model.layers[1].attn.qkv.depths) == 2
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 1, 8)]
    engine = Engine(qm, max_batch=3, max_seq_len=64)
    reqs = [Request(p, 6) for p in prompts]
    arrive_one_per_step(make_scheduler("depth", engine), reqs)
    assert engine.stats["mixed_stages"] > 0
    assert [r.output for r in reqs] == [full_depth_greedy(ref, p, 6) for p in prompts]


def test_gguf_export_of_a_plan_with_unique_layers_gives_its_logits(tmp_path):
    import gguf
    from test_gguf_export import tiny_tokenizer
    from transformers import AutoModelForCausalLM

    from looplm.commands import main
    from looplm.models import save_model

    tok = tiny_tokenizer()
    model = _middle_relaxed(len(tok))
    d = save_model(model, tok, tmp_path / "middle")
    out = tmp_path / "middle.gguf"
    assert main(["export-gguf", str(d), "--out", str(out)]) == 0
    assert gguf.GGUFReader(str(out)).fields["llama.block_count"].contents() == 6  # every depth, unrolled
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name, dtype=torch.float32).eval()
    ids = torch.randint(0, len(tok), (2, 12))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids).logits, atol=1e-4)
    assert main(["info", str(d)]) == 0


def test_info_names_the_plan(tmp_path, capsys):
    from test_gguf_export import tiny_tokenizer

    from looplm.commands import main
    from looplm.models import save_model

    tok = tiny_tokenizer()
    d = save_model(_middle_relaxed(len(tok)), tok, tmp_path / "m")
    assert main(["info", str(d)]) == 0
    assert "1 + 2 x 2 + 1 (cycle core): 2 shared layers x 2 loops, 2 unique" in capsys.readouterr().out


def test_the_exit_probe_reads_the_core_state_the_engine_decides_on():
    """With a coda only a leaving token runs it: the probe's features (fitting) are the core's states after and
    before each loop, the ones the engine passes to the exit decision, not the exits' coda outputs."""
    from looplm.serve.probe import core_states

    model = _middle_relaxed()
    x = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        _, states, _ = model.model(x, output_loop_states=True)
        after, before = core_states(model, x, states)
        plan = model.config.plan
        h0 = model.model.embed(x)
        prelude = model.model.run_depths(h0, plan.prelude)
        loop0 = model.model.run_depths(prelude, plan.loop(0))
        assert torch.allclose(before[0], prelude) and torch.allclose(after[0], loop0, atol=1e-6)
        assert not torch.allclose(after[0], states[0])  # the exit after loop 1 is the coda's output


def test_evaluation_per_exit_scores_each_exit_through_the_coda(vanilla):
    """`looplm eval`'s per-exit scorer: exit i's loss is the static exit's (prelude, i loops, coda, head)."""
    import torch.nn.functional as F

    m = convert(vanilla, loops=2, strategy="cycle", init="average", lora_ranks=4, prelude=1, coda=2)
    ids = torch.randint(0, 128, (2, 10))
    nll, _, tokens = m.exit_losses(ids)
    with torch.no_grad():
        for loops in (1, 2):
            logits = m(ids, num_loops=loops).logits[:, :-1]
            want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
            assert float(nll[loops - 1].sum()) == pytest.approx(float(want), rel=1e-5)
    assert tokens.tolist() == [9, 9]


def test_a_compiled_engine_serves_a_plan_with_unique_layers():
    """The prelude, the core's loops and the coda each run as compiled regions (or one whole-pass graph at batch 1):
    the tokens are full-depth greedy decoding's, sequence-wise and with loops mixed."""
    from conftest import arrive_one_per_step, full_depth_greedy

    from looplm.serve import Engine, Request, make_scheduler
    from looplm.serve.schedulers import warm_up

    model = _middle_relaxed()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 1)]
    want = [full_depth_greedy(model, p, 5) for p in prompts]
    for rows in (1, 3):
        engine = Engine(model, max_batch=rows, max_seq_len=64, compile=True)
        warm_up(engine)
        for scheduler in ("sequence", "depth") if rows > 1 else ("sequence",):
            reqs = [Request(p, 5) for p in prompts]
            arrive_one_per_step(make_scheduler(scheduler, engine), reqs)
            assert [r.output for r in reqs] == want, (rows, scheduler)


def test_intermediate_exits_with_a_cache_read_it_and_leave_it_as_the_path_wrote_it(vanilla):
    """lm-eval scores continuations on a cached context with every exit at once: the exit after loop 1 runs the coda
    on the cached keys and values of the context, as a static exit of those tokens does, and writes nothing."""
    from transformers import DynamicCache

    m = convert(vanilla, loops=2, strategy="middle-cycle", init="average", lora_ranks=4)
    ctx, cont = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 3))
    with torch.no_grad():
        cache = DynamicCache()
        m.model(ctx, past_key_values=cache)
        lengths = [layer.keys.shape[-2] for layer in cache.layers]
        _, states, _ = m.model(cont, past_key_values=cache, output_loop_states=True)
        assert [layer.keys.shape[-2] for layer in cache.layers] == [n + 3 for n in lengths]  # the full path's only
        again = DynamicCache()
        m.model(ctx, past_key_values=again)
        h, _, _ = m.model(cont, past_key_values=again, num_loops=1)
        assert torch.allclose(states[0], h, atol=1e-5)
