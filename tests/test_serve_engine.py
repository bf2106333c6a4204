"""Serving engine on small random models: exact agreement with full-depth greedy decoding of the
same model for all three schedulers, sampling, exit policies, bad input, cancel and failure."""

import pytest
import torch
from conftest import GEMMA_LIKE, TINY, arrive_one_per_step, full_depth_greedy

from looplm.convert import convert
from looplm.models import ConfigError, LoopLMConfig, LoopLMForCausalLM
from looplm.serve import Engine, ExitPolicy, Request, RequestError, SamplingParams, make_scheduler, replay
from looplm.serve.batch import DepthRunner
from looplm.serve.context_index import ContextIndex, copy_guesses
from looplm.serve.exits import parse_policy, with_copy_bonus


def _model(**kw):
    torch.manual_seed(0)
    return LoopLMForCausalLM(LoopLMConfig(**{**TINY, **kw})).eval()


@pytest.fixture(scope="module")
def models():
    vanilla = _model()
    gemma_like = _model(**GEMMA_LIKE)
    six = _model(num_hidden_layers=6)
    gemma_six = _model(**{**GEMMA_LIKE, "num_hidden_layers": 6, "depth_attention": ["sliding", "full"] * 3})
    return {
        # plans with unique layers (models/plan.py): 1 + 2 x 2 + 1, and a core of 2 x 2 before a coda of 2
        "middle": convert(six, loops=2, strategy="middle-cycle", init="average", lora_ranks=8, norms="per-depth"),
        "coda": convert(six, loops=2, coda=2, init="average", lora_ranks=8, norms="per-depth"),
        "gemma_middle": convert(gemma_six, loops=2, strategy="middle-cycle", lora_ranks=8, norms="per-depth"),
        "vanilla": vanilla,
        "recursive": convert(vanilla, loops=2, init="average", lora_ranks=0),
        "relaxed": convert(vanilla, loops=2, init="stepwise", lora_ranks=8, norms="per-depth"),
        "relaxed4": convert(vanilla, loops=4, init="average", lora_ranks=4, norms="per-depth"),
        "gemma_relaxed": convert(gemma_like, loops=2, init="average", lora_ranks=8, norms="per-depth"),
    }


def prompts(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 11, 1, 17, 8, 3, 9, 14][:n]
    return [torch.randint(0, 256, (L,), generator=g).tolist() for L in lens]


def run(model, ps, max_tokens, scheduler, stagger=True, **engine_kw):
    """Serve the prompts; with stagger, request i arrives before step i (deterministic arrivals in
    mid-flight, so depth-wise steps really mix loops)."""
    engine = Engine(model, **{"max_batch": 3, "max_seq_len": 64, **engine_kw})
    reqs = [Request(p, m) for p, m in zip(ps, max_tokens)]
    sched = make_scheduler(scheduler, engine)
    if not stagger:
        replay(sched, reqs)
        return engine, reqs
    arrive_one_per_step(sched, reqs)
    return engine, reqs


@pytest.mark.parametrize(
    "name", ["vanilla", "recursive", "relaxed", "relaxed4", "gemma_relaxed", "middle", "coda", "gemma_middle"]
)
@pytest.mark.parametrize("scheduler", ["static", "sequence", "depth"])
def test_exits_off_equals_full_depth_greedy(models, name, scheduler):
    model, ps = models[name], prompts()
    lens = [7, 3, 10, 5, 9, 6]  # varied output lengths: slots free at different times
    want = [full_depth_greedy(model, p, n) for p, n in zip(ps, lens)]
    assert len({tuple(w) for w in want}) > 2, "outputs should differ between prompts"
    engine, reqs = run(model, ps, lens, scheduler)
    assert [r.output for r in reqs] == want
    assert all(r.status == "done" for r in reqs)
    assert engine.cache.free_rows == engine.cache.num_rows  # every row came back
    if scheduler == "depth" and model.config.num_loops > 1:
        assert engine.stats["mixed_stages"] > 0  # some steps really mixed loops (and LoRA slots)


@pytest.mark.parametrize("name", ["relaxed", "relaxed4", "gemma_relaxed", "gemma_middle"])
def test_decode_attention_in_place_and_gathered_agree(models, name, monkeypatch):
    """Decode attention reads the cache in place (every step: fraction 0) or through a gather (never in
    place: fraction 2): with exits off both equal full-depth greedy decoding, and with every token exiting
    after loop 1 (threshold-0 margin, KV computed later) both give the same tokens."""
    model, ps = models[name], prompts()
    lens = [7, 3, 10, 5, 9, 6]
    want = [full_depth_greedy(model, p, n) for p, n in zip(ps, lens)]
    exited = {}
    for frac in (0.0, 2.0):
        monkeypatch.setattr(DepthRunner, "in_place_min_fraction", frac)
        engine, reqs = run(model, ps, lens, "depth")
        assert [r.output for r in reqs] == want and engine.stats["mixed_stages"] > 0
        _, reqs = run(model, ps, lens, "depth", exit_policy=ExitPolicy("margin", 0.0), kv_mode="later")
        exited[frac] = [r.output for r in reqs]
    assert exited[0.0] == exited[2.0]


@pytest.mark.parametrize("name", ["relaxed", "gemma_relaxed"])
def test_decode_with_every_row_busy_in_order_reads_in_place_without_a_scatter(models, name, monkeypatch):
    """One request in a one-row cache (batch-1 serving): decode attention takes the no-scatter path and the
    tokens equal full-depth greedy decoding."""
    model, ps = models[name], prompts()[:1]
    taken = []
    original = DepthRunner._attend_in_place
    monkeypatch.setattr(
        DepthRunner,
        "_attend_in_place",
        lambda self, attn, qd, groups, k, t, depth_at: (
            taken.append(groups[0][1] is None) or original(self, attn, qd, groups, k, t, depth_at)
        ),
    )
    _, reqs = run(model, ps, [6], "sequence", max_batch=1)
    assert reqs[0].output == full_depth_greedy(model, ps[0], 6)
    assert taken and all(taken)


def test_depth_batches_mix_loops_and_lora_slots(models):
    """In a depth-wise batch tokens at different loops share one call; the per-depth LoRA of each
    token is its own (grouped path), shown by exact agreement with per-token single-depth calls."""
    model = models["relaxed"]
    lin = model.model.layers[0].attn.q_proj
    x = torch.randn(1, 5, lin.in_features)
    slot = torch.tensor([[0, 1, 1, 0, 1]])
    got = lin(x, slot)
    want = torch.stack([lin(x[:, i], int(slot[0, i])) for i in range(5)], dim=1)
    torch.testing.assert_close(got, want)
    engine, reqs = run(model, prompts(), [7, 3, 10, 5, 9, 6], "depth")
    assert engine.stats["mixed_stages"] > 0


def test_replay_reports_every_step_so_a_progress_bar_moves_within_a_batch(models):
    engine = Engine(models["relaxed"], max_batch=2, max_seq_len=64)
    reqs = [Request(p, 6) for p in prompts(2)]
    made = []
    res = replay(make_scheduler("depth", engine), reqs, on_step=lambda: made.append(sum(len(r.output) for r in reqs)))
    assert len(made) == res["steps"] and made == sorted(made)
    assert made[0] < 12 == made[-1]  # the tokens so far, step by step, up to the 2 x 6 asked for


def test_sampling_seeded_and_param_effects(models):
    model = models["relaxed"]
    ps = prompts(3)

    def sampled(sp, sched="depth"):
        engine = Engine(model, max_batch=3, max_seq_len=64)
        reqs = [Request(p, 12, SamplingParams(**sp)) for p in ps]
        replay(make_scheduler(sched, engine), reqs)
        return [r.output for r in reqs]

    a = sampled(dict(temperature=1.0, seed=5))
    assert a == sampled(dict(temperature=1.0, seed=5), "sequence")  # same seed, same tokens, any scheduler
    assert a != sampled(dict(temperature=1.0, seed=6))
    # top_k=1 and a tiny top_p are greedy whatever the temperature
    greedy = [full_depth_greedy(model, p, 12) for p in ps]
    assert sampled(dict(temperature=2.0, top_k=1, seed=3)) == greedy
    assert sampled(dict(temperature=2.0, top_p=1e-6, seed=3)) == greedy


def test_top_k_restricts_support():
    from looplm.serve.sampling import sample

    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, 0.0]]).repeat(400, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    toks = sample(logits, [SamplingParams(temperature=5.0, top_k=2)] * 400, gens)
    assert set(toks.tolist()) == {0, 1}
    toks = sample(logits, [SamplingParams(temperature=50.0)] * 400, gens)
    assert set(toks.tolist()) == {0, 1, 2, 3, 4}


def test_sampling_draws_what_sorting_the_whole_vocabulary_draws():
    """The sampler sorts only the top candidates when they hold the nucleus; the draw must be the definition's:
    sort all tokens, keep the top-k/top-p prefix, invert the CDF at the row's uniform (an unfiltered row
    inverts it in vocabulary order: no sort at all)."""
    from looplm.serve.sampling import sample

    vocab, n = 4096, 96
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(n // 3, vocab, generator=gen) * 4  # the nucleus sits in a few dozen tokens
    flat = torch.randn(n // 3, vocab, generator=gen) * 0.1  # the nucleus spans most of the vocabulary
    mixed = torch.randn(n // 3, vocab, generator=gen) * 1.5
    logits = torch.cat([peaked, flat, mixed])
    settings = [dict(temperature=1.0, top_p=0.95), dict(temperature=0.7, top_p=1.0), dict(temperature=1.3, top_k=300)]
    params = [SamplingParams(**settings[i % 3], seed=i) for i in range(n)]

    def definition(row, p, g):
        probs = (logits[row] / p.temperature).softmax(-1)
        probs, order = probs.sort(descending=True) if p.top_p < 1 or p.top_k else (probs, torch.arange(vocab))
        before = probs.cumsum(0) - probs
        keep = (torch.arange(vocab) < (p.top_k or vocab)) & ((before < p.top_p) | (p.top_p >= 1))
        keep[0] = True
        cdf = (probs * keep).cumsum(0)
        u = torch.rand((), generator=g)
        return int(order[min(int(torch.searchsorted(cdf, u * cdf[-1])), vocab - 1)])

    got = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(n)])
    want = [definition(i, params[i], torch.Generator().manual_seed(i)) for i in range(n)]
    assert got.tolist() == want


@pytest.mark.parametrize("kv_mode", ["copy", "later"])
@pytest.mark.parametrize("scheduler", ["sequence", "depth"])
def test_early_exit_paths(models, kv_mode, scheduler):
    model, ps = models["relaxed"], prompts()
    lens = [8] * 6
    # threshold 0 exits every token after loop 1: outputs are the loop-1 exits
    engine, reqs = run(model, ps, lens, scheduler, exit_policy=ExitPolicy("softmax", 0.0), kv_mode=kv_mode)
    assert all(r.status == "done" and len(r.output) == 8 for r in reqs)
    assert all(r.exit_loops[0] == 2 and set(r.exit_loops[1:]) == {1} for r in reqs)  # prefill runs full depth
    assert engine.cache.free_rows == engine.cache.num_rows
    # the first exited token is the loop-1 argmax after an exact prompt
    with torch.no_grad():
        for p, r in zip(ps, reqs):
            ids = torch.tensor([p + r.output[:1]])
            h, states, _ = model.model(ids, output_loop_states=True)
            assert r.output[1] == int(model.exit_logits(states[0])[0, -1].argmax())
    if kv_mode == "later":
        # computing the skipped loops later gives the exact KV: the tokens are those of a model whose
        # every token exits at loop 1 but whose cache is full depth (teacher-forced check)
        assert engine.stats["kv_later_items"] >= sum(len(r.output) - 2 for r in reqs)
        with torch.no_grad():
            for p, r in zip(ps, reqs):
                ids = torch.tensor([p + r.output])
                _, states, _ = model.model(ids, output_loop_states=True)
                exit1 = model.exit_logits(states[0])[0, len(p) : -1].argmax(-1).tolist()
                assert r.output[1:] == exit1[: len(r.output) - 1]
    else:
        assert engine.stats["kv_copy_tokens"] > 0
    # where the steps' time went: every part was timed, and the parts add up to the steps' own time
    sec = engine.stats["seconds"]
    assert all(v > 0 for v in sec.values()), sec
    assert sum(sec.values()) == pytest.approx(engine.stats["stage_seconds"], rel=1e-6)


@pytest.mark.parametrize("kv_mode", ["copy", "later"])
@pytest.mark.parametrize("name", ["middle", "coda"])
def test_an_early_exit_runs_the_coda_on_the_cache(models, name, kv_mode):
    """With unique layers after the core, a token leaving after loop 1 runs the coda (reading the coda's cached
    keys and values of the tokens before it), then the head: the first exited token is the static exit of that
    one token after an exact prompt."""
    model, ps = models[name], prompts()
    engine, reqs = run(model, ps, [6] * 6, "depth", exit_policy=ExitPolicy("softmax", 0.0), kv_mode=kv_mode)
    assert all(r.status == "done" and set(r.exit_loops[1:]) == {1} for r in reqs)
    assert engine.cache.free_rows == engine.cache.num_rows
    with torch.no_grad():
        for p, r in zip(ps, reqs):
            out = model(torch.tensor([p]), use_cache=True)
            step = model(torch.tensor([r.output[:1]]), past_key_values=out.past_key_values, num_loops=1)
            assert r.output[1] == int(step.logits[0, -1].argmax())


@pytest.mark.parametrize("name", ["relaxed", "middle"])
def test_exit_policies_threshold_one_is_full_depth(models, name):
    model, ps = models[name], prompts()
    want = [full_depth_greedy(model, p, 6) for p in ps]
    for kind, thr in [("softmax", 1.01), ("margin", 1.01), ("entropy", -1.0), ("cosine", 1.01), ("oracle", None)]:
        engine, reqs = run(model, ps, [6] * 6, "depth", exit_policy=ExitPolicy(kind, thr))
        assert [r.output for r in reqs] == want, kind
        assert engine.stats["exits_per_loop"][0] == 0
    if model.config.plan.coda:  # the reference below runs every token's coda on loop 1, the engine on its cache
        return
    # the oracle records the first loop whose argmax equals the final one
    for r in reqs:
        assert len(r.oracle_loops) == 6 and set(r.oracle_loops) <= {1, 2}
        with torch.no_grad():
            _, states, _ = model.model(torch.tensor([ps[reqs.index(r)] + r.output]), output_loop_states=True)
            first = model.exit_logits(states[0])[0, len(ps[reqs.index(r)]) - 1 : -1].argmax(-1).tolist()
        assert [1 if a == b else 2 for a, b in zip(first, r.output)] == r.oracle_loops


def test_cosine_policy_exits_some(models):
    engine, reqs = run(models["relaxed"], prompts(), [8] * 6, "depth", exit_policy=ExitPolicy("cosine", -1.0))
    assert engine.stats["exits_per_loop"][0] == sum(len(r.output) - 1 for r in reqs)


def test_context_guess_is_what_copying_the_context_predicts():
    """ContextIndex, a token at a time, against the brute-force definition: after position p, the token that
    followed the last earlier occurrence of the 3-gram ending at p."""
    assert copy_guesses([1, 2, 3, 4, 1, 2, 3, 9, 2, 3]) == [-1] * 6 + [4, -1, -1, -1]
    g = torch.Generator().manual_seed(0)
    row = torch.randint(0, 4, (300,), generator=g).tolist()  # four words: most 3-grams repeat
    want = []
    for p in range(len(row)):
        earlier = [j for j in range(2, p) if row[j - 2 : j + 1] == row[p - 2 : p + 1]]
        want.append(row[earlier[-1] + 1] if p >= 2 and earlier else -1)
    assert copy_guesses(row) == want and sum(w >= 0 for w in want) > 200
    ctx = ContextIndex(row[:100])
    ctx.extend(row[100:])
    assert ctx.guess == want[-1] and ctx.tokens == row
    row = torch.randint(0, 12, (300,), generator=g).tolist()  # twelve words: backing off to 2- and 1-grams matters
    counts = [sum(w >= 0 for w in copy_guesses(row))]
    for min_n in (2, 1):
        want = []
        for p in range(len(row)):  # the longest repeated suffix of at most 3 and at least min_n tokens decides
            found = [
                [j for j in range(k - 1, p) if row[j - k + 1 : j + 1] == row[p - k + 1 : p + 1]]
                for k in range(min(3, p + 1), min_n - 1, -1)
            ]
            want.append(next((row[e[-1] + 1] for e in found if e), -1))
        assert copy_guesses(row, min_n=min_n) == want
        counts.append(sum(w >= 0 for w in want))
    assert counts[0] < counts[1] < counts[2], counts
    with pytest.raises(ValueError, match="min_n"):
        ContextIndex(n=3, min_n=4)


def test_copy_policies_parse_and_refuse_what_they_cannot_do():
    assert parse_policy("margin:0.19+copy") == ExitPolicy("margin", 0.19, copy=True)
    assert parse_policy("copy") == ExitPolicy("none", copy=True) and parse_policy("copy").active
    assert parse_policy("copy").needs_logits and parse_policy("cosine:0.9+copy").needs_logits
    assert not parse_policy("none").active and parse_policy("margin").copy is False
    assert parse_policy("margin:0.19+copy:4") == ExitPolicy("margin", 0.19, copy=True, copy_bonus=4.0)
    assert parse_policy("copy:2.5") == ExitPolicy("none", copy=True, copy_bonus=2.5)
    labels = ("margin:0.19+copy", "copy", "softmax:0.9", "margin:0.19+copy:4", "copy:2.5")
    assert [parse_policy(t).label for t in labels] == list(labels)
    for bad, why in (
        ("margin+copy:x", "number"),
        ("copy:-1", "finite"),
        ("copy:inf", "finite"),
        ("copy:nan", "finite"),
        ("margin+copy:", None),
    ):
        if why is None:  # an empty bonus is no bonus
            assert parse_policy(bad).copy_bonus == 0.0
            continue
        with pytest.raises(ValueError, match=why):
            parse_policy(bad)
    with pytest.raises(ValueError, match="needs the \\+copy rule"):
        ExitPolicy("margin", 0.2, copy_bonus=3.0)
    logits, guesses = torch.zeros(3, 5), torch.tensor([2, -1, 4])
    raised = parse_policy("copy:3").exit_logits(logits, guesses)
    assert raised[0, 2] == raised[2, 4] == 3.0 and raised.sum() == 6.0 and logits.sum() == 0
    with pytest.raises(ValueError, match="oracle"):
        parse_policy("oracle+copy")
    with pytest.raises(ValueError, match="modifier"):
        parse_policy("margin:0.2+bogus")
    with pytest.raises(ValueError, match="copy guess"):
        parse_policy("copy").decide(torch.zeros(2, 5), None, None)


@pytest.mark.parametrize("policy", ["copy", "margin:1.01+copy", "copy:3", "margin:0.6+copy:3"])
def test_copy_policy_exits_exactly_where_loop_1_continues_a_repeat(models, policy):
    """A token leaves after loop 1 exactly where loop 1's argmax is the context's copy guess, the guess's logit
    raised by the copy bonus (and, under margin, where the raised logits' margin reaches the threshold): a
    teacher-forced check on the full-depth KV that kv later keeps. It then is that argmax; the others run full
    depth."""
    model, pol = models["recursive"], parse_policy(policy)  # falls into repeating a token on the third prompt
    g = torch.Generator().manual_seed(3)  # prompts of six words: guesses loop 1 ranks close to its top
    ps = [[5, 6, 7, 8] * 4, [9, 9, 9, 9], [1, 2, 3, 1, 2, 3, 1, 2]] + torch.randint(0, 6, (3, 12), generator=g).tolist()
    engine, reqs = run(model, ps, [24] * len(ps), "depth", exit_policy=pol, kv_mode="later")
    exits = bonus_picks = 0
    with torch.no_grad():
        for p, r in zip(ps, reqs):
            ids = p + r.output
            _, states, _ = model.model(torch.tensor([ids]), output_loop_states=True)
            guesses = copy_guesses(ids)
            plain = model.exit_logits(states[0])[0]
            loop1 = with_copy_bonus(plain, torch.tensor(guesses), pol.copy_bonus)
            top2 = loop1.softmax(-1).topk(2, dim=-1).values
            margin_ok = ((top2[:, 0] - top2[:, 1] >= pol.threshold) & (pol.kind == "margin")).tolist()
            loop1, plain = loop1.argmax(-1).tolist(), plain.argmax(-1).tolist()
            final = model.exit_logits(states[1])[0].argmax(-1).tolist()
            for i in range(1, len(r.output)):  # the first token comes out of the prompt, at full depth
                q = len(p) + i - 1  # the position whose prediction is output[i]
                leaves = loop1[q] == guesses[q] or margin_ok[q]
                assert r.exit_loops[i] == (1 if leaves else 2)
                assert r.output[i] == (loop1[q] if leaves else final[q])
                exits += leaves
                bonus_picks += leaves and loop1[q] != plain[q]
    assert exits == engine.stats["exits_per_loop"][0] > 0
    assert (bonus_picks > 0) == (pol.copy_bonus > 0)  # the bonus changes tokens, not only where they leave


def test_bad_input_fails_only_that_request(models):
    model = models["relaxed"]
    engine = Engine(model, max_batch=2, max_seq_len=32)
    sched = make_scheduler("depth", engine)
    good = [Request(p, 6) for p in prompts(3)]
    bad = [
        Request(list(range(30)), 8),  # oversize: 30 + 8 - 1 > 32
        Request([1, 2, 3], 0),  # max_tokens 0
        Request([1, 2, 3], -4),
        Request([1, 2, 3], 4, SamplingParams(temperature=-1.0)),
        Request([1, 2, 3], 4, SamplingParams(temperature=float("nan"))),
        Request([1, 2, 3], 4, SamplingParams(temperature=1.0, top_p=0.0)),
        Request([1, 2, 3], 4, SamplingParams(top_k=-2)),
        Request([], 4),
        Request([1, 999], 4),  # token id outside the vocabulary
    ]
    reqs = good[:1] + bad + good[1:]
    replay(sched, reqs)
    for r in bad:
        assert r.status == "error" and r.error, r
    assert "max_tokens" in bad[1].error and "positions" in bad[0].error and "temperature" in bad[3].error
    assert [r.output for r in good] == [full_depth_greedy(model, p, 6) for p in prompts(3)]
    assert engine.cache.free_rows == 2
    with pytest.raises(RequestError):
        SamplingParams(top_p=1.5).validate()


@pytest.mark.parametrize("scheduler", ["static", "sequence", "depth"])
def test_cancel_and_failure_free_rows_and_spare_others(models, scheduler):
    model = models["relaxed"]
    ps = prompts(5)
    want = [full_depth_greedy(model, p, 8) for p in ps]
    engine = Engine(model, max_batch=3, max_seq_len=64)
    sched = make_scheduler(scheduler, engine)
    reqs = [Request(p, 8) for p in ps]
    victim, failing = reqs[1], reqs[2]
    rows_seen = {}

    def cancel_victim(req, tok):
        if len(req.output) == 3 and not victim.finished:
            rows_seen["victim"] = victim.row
            sched.cancel(victim)

    def explode(req, tok):
        if len(req.output) == 2:
            rows_seen["failing"] = req.row
            raise RuntimeError("client went away")

    reqs[0].on_token = cancel_victim
    failing.on_token = explode
    replay(sched, reqs)
    assert victim.status == "cancelled" and len(victim.output) < 8
    assert failing.status == "error" and "client went away" in failing.error and len(failing.output) == 2
    for i in (0, 3, 4):
        assert reqs[i].status == "done" and reqs[i].output == want[i]
    assert engine.cache.free_rows == 3 and not engine.cache.used_rows
    # queued requests 3 and 4 got the rows the cancelled and the failed request gave back
    assert reqs[3].status == "done"


def test_non_cycle_sharing_rejects_mixed_loops_but_serves_sequence(models):
    torch.manual_seed(0)
    m = convert(models["vanilla"], loops=2, strategy="sequence", lora_ranks=4)
    ps = prompts(4)
    want = [full_depth_greedy(m, p, 5) for p in ps]
    _, reqs = run(m, ps, [5] * 4, "sequence")
    assert [r.output for r in reqs] == want
    with pytest.raises(ConfigError, match="cycle"):
        run(m, ps, [5] * 4, "depth")


def test_entropy_policy_exits_where_the_entropy_is_low_enough():
    """The entropy rule against entropies worked by hand: a uniform row over 4 tokens has log 4 = 1.386 nats, an
    even split of two log 2 = 0.693, a row with one logit 10 above three others 0.0014 nats."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -1e9, -1e9], [10.0, 0.0, 0.0, 0.0]])
    h = torch.zeros(3, 8)
    decide = lambda thr: ExitPolicy("entropy", thr).decide(logits, h, h).tolist()  # noqa: E731
    assert decide(0.001) == [False, False, False]
    assert decide(0.002) == [False, False, True]
    assert decide(0.69) == [False, False, True] and decide(0.70) == [False, True, True]
    assert decide(1.38) == [False, True, True] and decide(1.39) == [True, True, True]


def test_entropy_policy_fires_in_the_engine(models):
    """At a threshold above any entropy the vocabulary allows (log V), every decoded token leaves after loop 1."""
    engine, reqs = run(models["relaxed"], prompts(), [8] * 6, "depth", exit_policy=ExitPolicy("entropy", 100.0))
    assert engine.stats["exits_per_loop"][0] == sum(len(r.output) - 1 for r in reqs) > 0


class _RecordKV:
    """A cache for the model's own forward (transformers' ``update(k, v, layer)`` interface) that keeps the keys and
    values each depth wrote: the reference of what a depth caches, computed without the engine."""

    def __init__(self):
        self.kv = {}

    def update(self, k, v, depth):
        self.kv[depth] = (k[0], v[0])  # [KV, t, d]
        return k, v

    def get_seq_length(self):
        return 0


@pytest.mark.parametrize("name", ["relaxed", "relaxed4", "gemma_relaxed"])
def test_kv_copy_fills_skipped_depths_with_the_loop_1_state_projected(models, name):
    """kv mode ``copy`` by its definition (engine.py): a token that leaves after loop 1 gets, at every depth it
    skipped, the keys and values that depth computes from the token's loop-1 output. The reference is the model's
    own forward, not the engine: loop 1 run over the same tokens gives the loop-1 states (exact in the engine too,
    since every token runs loop 1), and each skipped depth's block, run on those states with a recording cache,
    gives the keys and values it would store. Prompt positions (full depth) and loop-1 depths hold the full
    forward's own keys and values; the copied entries are not those (the full depth's) at the deeper depths."""
    model = models[name]
    c = model.config
    K, L = c.num_shared_layers, c.num_hidden_layers
    prompt, n = prompts()[1], 8
    engine = Engine(model, max_batch=1, max_seq_len=64, exit_policy=ExitPolicy("softmax", 0.0), kv_mode="copy")
    req = Request(prompt, n)
    replay(make_scheduler("depth", engine), [req])
    assert req.status == "done" and req.exit_loops == [c.num_loops] + [1] * (n - 1)
    assert engine.stats["kv_copy_tokens"] == n - 1
    P = len(prompt)
    ids = torch.tensor([prompt + req.output[:-1]])  # every position the engine ran (the last token never is)
    T = ids.shape[1]
    full = _RecordKV()
    with torch.no_grad():
        _, states, _ = model.model(ids, past_key_values=full, output_loop_states=True)
        h1 = states[0]  # loop 1's output at every position
        tables = model.model.rotary(torch.arange(T)[None], h1.dtype)
        copied = _RecordKV()
        for d in range(K, L):
            cos, sin = tables[c.depth_attention[d]]
            model.model.layers[c.layer_map[d]](h1, c.slot_map[d], cos, sin, None, copied, d)
    R = engine.cache.num_rows
    got = lambda d: (engine.cache.k[d * R, :, :T], engine.cache.v[d * R, :, :T])  # noqa: E731 (row 0: the only one)
    close = dict(rtol=1e-4, atol=1e-4)
    for d in range(L):
        (k, v), (fk, fv) = got(d), full.kv[d]
        torch.testing.assert_close(k[:, :P], fk[:, :P], **close)  # the prompt ran every depth
        torch.testing.assert_close(v[:, :P], fv[:, :P], **close)
        if d < K:  # loop 1 is exact for every token
            torch.testing.assert_close(k, fk, **close)
            torch.testing.assert_close(v, fv, **close)
        else:  # the decoded tokens left after loop 1: their entries are the loop-1 state projected
            ck, cv = copied.kv[d]
            torch.testing.assert_close(k[:, P:], ck[:, P:], **close)
            torch.testing.assert_close(v[:, P:], cv[:, P:], **close)
    # the first skipped depth reads loop 1's output in the full forward too; the last (a depth further on) does
    # not, so there the copy differs from the full depth's entries (which kv mode ``later`` would hold)
    torch.testing.assert_close(got(K)[0][:, P:], full.kv[K][0][:, P:], **close)
    assert (got(L - 1)[1][:, P:] - full.kv[L - 1][1][:, P:]).abs().max() > 1e-2


def test_entropy_policy_splits_tokens_at_the_threshold_by_entropies_worked_by_hand(models):
    """An entropy threshold between the loop-1 entropies of a run: some tokens leave after loop 1 and some do not,
    each exactly where its loop-1 distribution's entropy -sum p ln p (computed here in float64 from the model's own
    forward, not by the policy) is <= the threshold. kv mode ``later`` keeps every cache entry exact, so a token
    that stays is the full forward's argmax and one that leaves is loop 1's."""
    model, ps = models["relaxed"], prompts()
    n = 10

    def loop_logits(p, out):
        with torch.no_grad():
            ids = torch.tensor([p + out[:-1]])
            _, states, _ = model.model(ids, output_loop_states=True)
            first = model.exit_logits(states[0], 0)[0, len(p) - 1 :].double()
            last = model(ids).logits[0, len(p) - 1 :].double()
        return first, last

    def entropy(logits):
        logp = logits.log_softmax(-1)
        return -(logp.exp() * logp).sum(-1)

    # the threshold: in the middle half of the decoded tokens' loop-1 entropies of a full-depth run, the middle of
    # the widest gap between two of them (tokens the exits do not change keep their entropies)
    full = [full_depth_greedy(model, p, n) for p in ps]
    ents = torch.cat([entropy(loop_logits(p, o)[0])[1:] for p, o in zip(ps, full)]).sort().values
    mid = ents[len(ents) // 4 : 3 * len(ents) // 4]
    gap = int((mid[1:] - mid[:-1]).argmax())
    thr = float(mid[gap] + mid[gap + 1]) / 2
    engine, reqs = run(model, ps, [n] * len(ps), "depth", exit_policy=ExitPolicy("entropy", thr), kv_mode="later")
    left = stayed = 0
    for p, r in zip(ps, reqs):
        assert r.status == "done" and len(r.output) == n and r.exit_loops[0] == 2  # prompts never exit
        first, last = loop_logits(p, r.output)
        ent = entropy(first)[1:]  # token j >= 1 was decided after loop 1 of the token before it
        assert (ent - thr).abs().min() > 1e-4  # no token so close to the threshold that rounding could decide it
        want_exit = (ent <= thr).tolist()
        assert [e == 1 for e in r.exit_loops[1:]] == want_exit
        for j, leaves in enumerate(want_exit, start=1):
            assert r.output[j] == int((first if leaves else last)[j].argmax())
        left, stayed = left + sum(want_exit), stayed + len(want_exit) - sum(want_exit)
    assert left >= 5 and stayed >= 5
    assert engine.stats["exits_per_loop"][0] == left


def test_margin_exit_is_the_gap_between_the_top_two_not_the_top_probability():
    """Two rows whose top probability is the same (0.5), their seconds 0.45 and 0.25: the softmax rule at 0.4 lets
    both leave; the margin rule lets neither leave at 0.4 and, at 0.2, only the row whose gap (0.25) clears it."""
    probs = torch.tensor([[0.5, 0.45, 0.05], [0.5, 0.25, 0.25]])
    logits, h = probs.log(), torch.zeros(2, 4)
    assert ExitPolicy("softmax", 0.4).decide(logits, h, h).tolist() == [True, True]
    assert ExitPolicy("margin", 0.4).decide(logits, h, h).tolist() == [False, False]
    assert ExitPolicy("margin", 0.2).decide(logits, h, h).tolist() == [False, True]


def test_softmax_and_margin_exits_disagree_where_the_second_choice_is_close():
    """Top 0.6, second 0.35: confident enough for ``softmax:0.5`` (0.6), not for ``margin:0.5`` (gap 0.25), which
    lets it leave at 0.2; the policies as the command line names them."""
    logits, h = torch.tensor([[0.6, 0.35, 0.05]]).log(), torch.zeros(1, 4)
    assert parse_policy("softmax:0.5").decide(logits, h, h).tolist() == [True]
    assert parse_policy("margin:0.5").decide(logits, h, h).tolist() == [False]
    assert parse_policy("margin:0.2").decide(logits, h, h).tolist() == [True]
