"""Exit adapters (models/exit_adapter.py): a head LoRA or an affine map per intermediate loop exit.

Zero-init adapters leave every exit as it was; trained ones change the intermediate exits and never the
final one; they save, load (also through transformers' Auto classes) and count; the engine, evaluation and
training use each row's own loop; `looplm train --exit-adapter ... --freeze-body` trains only the adapter."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, full_depth_greedy
from test_train_fixtures import build_corpus, make_models

from looplm.commands import main
from looplm.convert import convert, count_parameters, unroll
from looplm.errors import UsageError
from looplm.models import (
    LoopLMConfig,
    LoopLMForCausalLM,
    add_exit_adapters,
    freeze_all_but_exit_adapter,
    load_model,
    parse_exit_adapter,
    save_model,
)
from looplm.serve import Engine, ExitPolicy, Request, make_scheduler, replay
from looplm.train.loop import TrainConfig, train
from looplm.train.losses import objective

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(TINY, num_hidden_layers=6)
SPECS = [("head-lora", 8), ("affine", None)]


def relaxed(loops=3, seed=0):
    torch.manual_seed(seed)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**SMALL)).eval()
    return convert(vanilla, loops=loops, init="average", lora_ranks=4, norms="per-depth")


def relaxed_with(kind, rank, loops=3):
    model = relaxed(loops)
    add_exit_adapters(model, kind, rank)
    return model


def trained(model, seed=1, scale=0.05):
    """The adapter as if trained: every parameter random (small, so the exits move but stay sane)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.exit_adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def loop_states(model, ids):
    with torch.no_grad():
        _, states, _ = model.model(ids, output_loop_states=True)
    return states


IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def with_new_adapter(kind, rank):
    """A relaxed model given a zero-init adapter of ``kind``, with what it computed on IDS before: its loop
    states, their plain exits and its output."""
    model = relaxed()
    states = loop_states(model, IDS)
    with torch.no_grad():
        plain = [model.exit_logits(h) for h in states]
        out = model(IDS).logits
        add_exit_adapters(model, kind, rank)
    return model, states, plain, out


@pytest.mark.parametrize("kind,rank", SPECS)
def test_zero_init_adapter_leaves_every_exit_identical(kind, rank):
    model, states, plain, out = with_new_adapter(kind, rank)
    assert model.config.exit_adapter["kind"] == kind
    with torch.no_grad():
        for i, h in enumerate(states):
            assert torch.equal(model.exit_logits(h, loop=i), plain[i]), i
        assert torch.equal(model(IDS).logits, out)


@pytest.mark.parametrize("kind,rank", SPECS)
def test_trained_adapter_changes_intermediate_exits_only(kind, rank):
    model, states, plain, out = with_new_adapter(kind, rank)
    trained(model)
    B = model.config.num_loops
    with torch.no_grad():
        for i in range(B - 1):
            assert (model.exit_logits(states[i], loop=i) - plain[i]).abs().max() > 1e-3, i
            # a static exit through forward uses the adapter of its loop
            assert torch.allclose(model(IDS, num_loops=i + 1).logits, model.exit_logits(states[i], loop=i), atol=1e-5)
        assert torch.equal(model.exit_logits(states[-1], loop=B - 1), plain[-1])
        assert torch.equal(model.exit_logits(states[-1]), plain[-1])
        assert torch.equal(model(IDS).logits, out)
        with pytest.raises(ValueError, match="loop index"):
            model.exit_logits(states[0], loop=B)


@pytest.mark.parametrize("kind,rank", SPECS)
def test_rows_from_different_loops_in_one_call_use_their_own_adapter(kind, rank):
    model = trained(relaxed_with(kind, rank))
    states = loop_states(model, IDS)
    loops = torch.randint(0, 3, IDS.shape, generator=torch.Generator().manual_seed(4))
    h = torch.stack(states)  # [B, b, t, d]
    mixed_h = h.gather(0, loops[None, ..., None].expand(1, *h.shape[1:]))[0]
    with torch.no_grad():
        got = model.exit_logits(mixed_h, loop=loops)
        per_loop = torch.stack([model.exit_logits(s, loop=i) for i, s in enumerate(states)])
    want = per_loop.gather(0, loops[None, ..., None].expand(1, *per_loop.shape[1:]))[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(set(loops.flatten().tolist())) == 3


@pytest.mark.parametrize("kind,rank", SPECS)
def test_save_load_and_auto_class_round_trip(kind, rank, tmp_path):
    from transformers import AutoModelForCausalLM

    model = trained(relaxed_with(kind, rank))
    save_model(model, None, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    auto = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    states = loop_states(model, IDS)
    with torch.no_grad():
        for other in (loaded, auto):
            assert other.config.exit_adapter == model.config.exit_adapter
            for i, h in enumerate(states):
                assert torch.equal(other.exit_logits(h, loop=i), model.exit_logits(h, loop=i))
    # unrolling to a vanilla model drops the adapter (there is no intermediate exit left)
    dense = unroll(model)
    assert dense.exit_adapter is None and dense.config.exit_adapter is None
    with torch.no_grad():
        torch.testing.assert_close(dense(IDS).logits, model(IDS).logits, atol=1e-4, rtol=1e-4)


def test_parameter_counts_keep_n_emb_and_add_to_the_total():
    base = count_parameters(relaxed())
    h, v, B = SMALL["hidden_size"], SMALL["vocab_size"], 3
    for (kind, rank), size in zip(SPECS, [(B - 1) * 8 * (h + v), (B - 1) * (h * h + h)]):
        counts = count_parameters(relaxed_with(kind, rank))
        assert counts["exit_adapter"] == size
        assert counts["total"] == base["total"] + size
        assert counts["n_emb"] == base["n_emb"] and counts["lora"] == base["lora"]
    assert base["exit_adapter"] == 0


def test_looplm_info_prints_the_adapter(tmp_path, capsys):
    save_model(relaxed_with("head-lora", 8), None, tmp_path / "m")
    assert main(["info", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "exit adapter" in out and "head-lora:8" in out and f"{2 * 8 * (64 + 256):,}" in out


def test_bad_specs_are_usage_errors():
    for text in ("lens", "head-lora", "head-lora:0", "head-lora:-3", "head-lora:x", "affine:4", "head-lora:65"):
        with pytest.raises(UsageError):
            spec = parse_exit_adapter(text)
            add_exit_adapters(relaxed(), spec["kind"], spec.get("rank"))
    assert parse_exit_adapter("head-lora:128") == {"kind": "head-lora", "rank": 128}
    assert parse_exit_adapter("affine") == {"kind": "affine"}
    with pytest.raises(UsageError, match="one loop"):
        torch.manual_seed(0)
        add_exit_adapters(LoopLMForCausalLM(LoopLMConfig(**SMALL)), "affine")
    with pytest.raises(UsageError, match="already has.*--exit-adapter none"):
        add_exit_adapters(relaxed_with("affine", None), "head-lora", 4)
    with pytest.raises(UsageError, match="no exit adapter"):
        freeze_all_but_exit_adapter(relaxed())
    model = relaxed_with("affine", None)
    params = freeze_all_but_exit_adapter(model)
    assert {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad}
    assert len(params) == 2


# --- serving ---------------------------------------------------------------------------------------


def prompts(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in [5, 11, 1, 8, 3][:n]]


def serve(model, ps, n, scheduler="depth", **kw):
    engine = Engine(model, max_batch=3, max_seq_len=64, **kw)
    reqs = [Request(p, n) for p in ps]
    replay(make_scheduler(scheduler, engine), reqs)
    assert all(r.status == "done" for r in reqs), [r.error for r in reqs]
    return engine, reqs


@pytest.mark.parametrize("kind,rank", SPECS)
@pytest.mark.parametrize("scheduler", ["static", "sequence", "depth"])
def test_engine_with_exits_off_is_full_depth_greedy(kind, rank, scheduler):
    model = trained(relaxed_with(kind, rank))
    ps = prompts()
    _, reqs = serve(model, ps, 6, scheduler)
    assert [r.output for r in reqs] == [full_depth_greedy(model, p, 6) for p in ps]


@pytest.mark.parametrize("kind,rank", SPECS)
@pytest.mark.parametrize("policy", ["softmax:0.0", "cosine:-1.0"])
def test_engine_exit_logits_use_the_adapter_of_the_loop(kind, rank, policy):
    """Every token after the prompt's leaves after loop 1 (threshold 0 / -1) and its KV of loops 2..B is
    computed later, exactly: the outputs are the teacher-forced loop-1 exits *with* the adapter, which a
    trained adapter makes differ from the plain loop-1 exits. Prefills emit at loop B in the same calls,
    so one logits call mixes rows of loops 1 and B."""
    model = trained(relaxed_with(kind, rank), seed=2, scale=0.5)  # large enough to move loop 1's argmax
    kind_, thr = policy.split(":")
    ps = prompts()
    engine, reqs = serve(model, ps, 8, "depth", exit_policy=ExitPolicy(kind_, float(thr)), kv_mode="later")
    assert engine.stats["exits_per_loop"][0] == sum(len(r.output) - 1 for r in reqs)
    differs = 0
    with torch.no_grad():
        for p, r in zip(ps, reqs):
            states = loop_states(model, torch.tensor([p + r.output]))
            want = model.exit_logits(states[0], loop=0)[0, len(p) : -1].argmax(-1).tolist()
            plain = model.exit_logits(states[0])[0, len(p) : -1].argmax(-1).tolist()
            assert r.output[1:] == want[: len(r.output) - 1]
            assert r.output[0] == int(model.exit_logits(states[-1])[0, len(p) - 1].argmax())
            differs += want != plain
    assert differs, "the adapter should change some loop-1 exit, or this test cannot fail"


def test_probe_data_and_oracle_trajectories_use_the_adapter():
    """The exit probe's labels and the simulation's oracle exits read loop i's exit with its adapter."""
    from looplm.bench.hypothetical import oracle_trajectories
    from looplm.serve.probe import collect
    from looplm.train.exit_fit import fit_exit_adapter

    model = relaxed_with("head-lora", 8)
    rows = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(6)).tolist()
    # fitted toward the final loop on these rows: the exits of loops 1 and 2 then often agree with it
    fit_states = [s.flatten(0, 1) for s in loop_states(model, torch.tensor(rows))]
    with torch.no_grad():
        final = model.exit_logits(fit_states[-1])
    fit_exit_adapter(model, fit_states, final, steps=100, lr=3e-2, batch_rows=36)
    _, labels, args = collect(model, rows)
    states = [s[0] for s in loop_states(model, torch.tensor(rows[:1]))]
    with torch.no_grad():
        want = torch.stack([model.exit_logits(h, loop=i).argmax(-1) for i, h in enumerate(states)])
        plain = torch.stack([model.exit_logits(h).argmax(-1) for h in states])
    assert torch.equal(args[:, :12], want) and not torch.equal(want, plain)
    assert torch.equal(labels[:, :12], want[:-1] == want[-1])
    traj = oracle_trajectories(model, rows[0], prefix_len=2, decode_len=10, samples=1)[0]

    def oracle(arg):  # the first loop whose argmax is the final one
        return [next(i + 1 for i in range(3) if arg[i, t] == arg[2, t]) for t in range(1, 11)]

    assert traj == oracle(want) and oracle(want) != oracle(plain)


# --- evaluation ------------------------------------------------------------------------------------


def test_perplexity_per_loop_uses_the_adapter():
    from looplm.eval.perplexity import score_windows

    class Tok:  # score_windows decodes the scored tokens to count bytes
        def decode(self, ids):
            return "x" * len(ids)

    windows = [list(range(i, i + 12)) for i in range(0, 60, 12)]
    model = relaxed()
    plain = score_windows(model, Tok(), windows)
    add_exit_adapters(model, "affine")
    trained(model)
    adapted = score_windows(model, Tok(), windows)
    assert adapted["per_loop"][-1] == plain["per_loop"][-1]
    assert all(a["perplexity"] != b["perplexity"] for a, b in zip(adapted["per_loop"][:-1], plain["per_loop"][:-1]))
    states = loop_states(model, torch.tensor(windows))
    with torch.no_grad():
        nll = sum(
            torch.nn.functional.cross_entropy(
                model.exit_logits(states[0][j, :-1], loop=0), torch.tensor(windows[j][1:]), reduction="sum"
            )
            for j in range(len(windows))
        )
    assert adapted["per_loop"][0]["perplexity"] == pytest.approx(float(torch.exp(nll / (11 * 5))), rel=1e-5)


@pytest.mark.real
def test_lm_eval_static_exits_and_exit_rules_use_the_adapter(smollm2_tokenizer):
    """The lm-eval model scores loop 1 with loop 1's adapter (= forward(num_loops=1), which applies it),
    through the static exit, the exit rule and greedy generation; without the adapter the scores differ."""
    from lm_eval.api.instance import Instance

    from looplm.eval.lm_eval_adapter import LoopLMEval

    tok = smollm2_tokenizer
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**{**SMALL, "vocab_size": 49152, "num_hidden_layers": 4})).eval()
    plain = convert(vanilla, loops=2, init="average", lora_ranks=4)
    model = convert(vanilla, loops=2, init="average", lora_ranks=4)
    add_exit_adapters(model, "head-lora", 8)
    trained(model, scale=0.5)
    pairs = [("The cat sat on the", " mat"), ("Question: Which is the largest planet?\nAnswer:", " Jupiter, by far")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]

    def forward_loglik(m, ctx, cont):
        with torch.no_grad():
            logp = m(torch.tensor([ctx + cont]), num_loops=1).logits[0].float().log_softmax(-1)
        return float(logp[torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), torch.tensor(cont)].sum())

    lm = LoopLMEval(pretrained=model, tokenizer=tok, exit_loop=1, batch_size=2)
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    base = LoopLMEval(pretrained=plain, tokenizer=tok, exit_loop=1, batch_size=2).loglikelihood(reqs, disable_tqdm=True)
    for (c, x), (ll, _), (ll_plain, _) in zip(pairs, got, base):
        ctx, cont = lm._encode_pair(c, x)
        assert ll == pytest.approx(forward_loglik(model, ctx, cont), abs=2e-4)
        assert abs(ll - ll_plain) > 1e-2
    rule = LoopLMEval(
        pretrained=model,
        tokenizer=tok,
        batch_size=2,
        exit_rule=lambda logits, loop: torch.ones(len(logits), dtype=torch.bool),
    )
    rule.use_exit_rule = True
    assert [a[0] for a in rule.loglikelihood(reqs, disable_tqdm=True)] == pytest.approx([a[0] for a in got], abs=2e-4)
    out = lm.generate_until(
        [Instance("generate_until", {}, ("Once upon a time", {"until": ["\n\n"], "max_gen_toks": 5}), 0)]
    )[0]
    ids = lm.tok_encode("Once upon a time")
    n0 = len(ids)
    with torch.no_grad():
        for _ in range(5):
            nxt = int(model(torch.tensor([ids]), num_loops=1).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            ids.append(nxt)
    assert out == tok.decode(ids[n0:], skip_special_tokens=True).split("\n\n")[0]


# --- training --------------------------------------------------------------------------------------


def test_teacher_exits_distil_the_teacher_into_intermediate_exits():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 6))
    teacher = torch.randn(2, 6, 32)
    exits = [torch.randn(2, 6, 32, requires_grad=True) for _ in range(2)]
    _, plain = objective(exits, ids, teacher, early_exit="aggressive", self_distill=True)
    loss, parts = objective(exits, ids, teacher, early_exit="aggressive", self_distill=True, teacher_exits=True)
    assert "kd_1" in parts and "kd_1" not in plain and "sd_1" in parts
    want = 0.1 * (0.5 * parts["ce_1"] + 0.5 * parts["kd_1"] + parts["sd_1"]) + 0.5 * parts["ce_2"] + 0.5 * parts["kd"]
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exit")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


def train_student(setup, out, **settings) -> dict:
    """Train the fixture's student on its corpus into ``out``, quietly: batches of 2, aggressive early exit, fp32."""
    _, models, corpus = setup
    base = dict(model=str(models["student"]), data=str(corpus), out=str(out), batch_size=2, early_exit="aggressive")
    return train(TrainConfig(**base, precision="fp32", progress=False, **settings), lambda *a: None)


@pytest.mark.parametrize("spec", ["head-lora:4", "affine"])
def test_freeze_body_trains_only_the_adapter(setup, spec):
    tmp, models, _ = setup
    out = tmp / f"frozen-{spec.replace(':', '')}"
    frozen = dict(exit_adapter=spec, freeze_body=True, self_distill=True, teacher=str(models["teacher"]))
    train_student(setup, out, max_steps=2, lr=1e-2, **frozen)
    before, _ = load_model(models["student"])
    after, _ = load_model(out / "final")
    assert after.config.exit_adapter == parse_exit_adapter(spec)
    body = dict(before.named_parameters())
    for name, p in after.named_parameters():
        if name.startswith("exit_adapter."):
            continue
        assert torch.equal(p, body[name]), name
    # the adapter moved off its identity start, so loop 1's exit changed and the final exit did not
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        s_before, s_after = loop_states(before, ids), loop_states(after, ids)
        assert torch.equal(s_before[0], s_after[0])
        assert not torch.allclose(after.exit_logits(s_after[0], loop=0), before.exit_logits(s_before[0]), atol=1e-4)
        assert torch.equal(after(ids).logits, before(ids).logits)


def test_frozen_run_resumes_and_older_run_files_still_resume(setup):
    import json

    tmp, _, _ = setup
    out = tmp / "resume"
    frozen = dict(exit_adapter="affine", freeze_body=True, save_every_steps=1)
    train_student(setup, out, max_steps=1, **frozen)
    assert train_student(setup, out, max_steps=2, resume=True, **frozen)["steps"] == 2
    with pytest.raises(UsageError, match="freeze_body"):
        train_student(setup, out, max_steps=3, resume=True, **{**frozen, "freeze_body": False})
    # a run.json written before the options existed resumes with their defaults
    run = json.loads((out / "run.json").read_text())
    for k in ("exit_adapter", "freeze_body"):
        run["config"].pop(k)
    (out / "run.json").write_text(json.dumps(run))
    with pytest.raises(UsageError, match="exit_adapter: None -> 'affine'"):
        train_student(setup, out, max_steps=3, resume=True, **frozen)


def test_training_with_an_adapter_and_the_body_updates_both(setup):
    tmp, models, _ = setup
    out = tmp / "unfrozen"
    train_student(setup, out, max_steps=2, exit_adapter="affine", lr=1e-2)
    before, _ = load_model(models["student"])
    after, _ = load_model(out / "final")
    assert after.exit_adapter.weight.abs().max() > 0
    assert not torch.equal(after.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)


def _fails(capsys, *argv, match):
    code = main(["train", *map(str, argv), "--precision", "fp32", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("looplm train: error:"), err
    assert match in err, err


def test_bad_train_flags_are_one_line_errors(setup, capsys):
    tmp, models, corpus = setup
    base = [models["student"], "--data", corpus, "--max-steps", 1]
    early = [*base, "--early-exit", "aggressive"]
    _fails(capsys, *early, "--out", tmp / "e1", "--freeze-body", match="no exit adapter")
    _fails(capsys, *early, "--out", tmp / "e2", "--exit-adapter", "lens", match="unknown exit adapter kind")
    _fails(capsys, *early, "--out", tmp / "e3", "--exit-adapter", "head-lora:0", match="rank >= 1")
    _fails(capsys, *base, "--out", tmp / "e4", "--exit-adapter", "affine", match="--early-exit")
    frozen_lora = ["--exit-adapter", "affine", "--freeze-body", "--train", "lora"]
    _fails(capsys, *early, "--out", tmp / "e5", *frozen_lora, match="drop --train")
    assert not any((tmp / f"e{i}").exists() for i in range(1, 6))


@pytest.mark.parametrize("kind,rank", SPECS)
def test_fit_exit_adapter_on_cached_states(kind, rank):
    """Fitting on cached states: loop 1's exit moves toward the target (the final loop's logits, or token
    ids), the final exit and every other parameter stay as they were, and no other .grad is touched."""
    from looplm.train.exit_fit import fit_exit_adapter

    model = relaxed_with(kind, rank)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(5))
    states = [s.flatten(0, 1) for s in loop_states(model, ids)]
    body = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("exit_adapter.")}
    with torch.no_grad():
        final = model.exit_logits(states[-1])
        start = [
            float(
                torch.nn.functional.kl_div(
                    model.exit_logits(s, loop=i).log_softmax(-1),
                    final.log_softmax(-1),
                    log_target=True,
                    reduction="batchmean",
                )
            )
            for i, s in enumerate(states[:-1])
        ]
    end = fit_exit_adapter(model, states, final, steps=60, lr=1e-2, batch_rows=32)
    assert len(end) == 2 and all(e < 0.7 * s for s, e in zip(start, end)), (start, end)
    for n, p in model.named_parameters():
        if not n.startswith("exit_adapter."):
            assert torch.equal(p, body[n]) and p.grad is None, n
    with torch.no_grad():
        assert torch.equal(model.exit_logits(states[-1], loop=2), final)
    targets = ids[:, 1:].flatten()
    ce = fit_exit_adapter(model, [s.view(4, 16, -1)[:, :-1].flatten(0, 1) for s in states], targets, steps=5)
    assert len(ce) == 2
    with pytest.raises(UsageError, match="no exit adapter"):
        fit_exit_adapter(relaxed(), states, final)
    with pytest.raises(UsageError, match="intermediate loops"):
        fit_exit_adapter(model, states[:1], final)
