"""Speculative decoding (serve/speculative.py): drafts from the context, from loop 1, or both, verified at full
depth. Greedy output equals full-depth greedy decoding on small random models of every kind and family; rejected
drafts leave nothing in the KV cache; sampled output has the model's distribution (chi-square on a vocabulary
of 8); the CLI and the server report acceptance."""

import json
import re

import pytest
import test_serve_engine as engine_tests
import torch
from conftest import FAMILIES, TINY, arrive_one_per_step, full_depth_greedy, make_hf_model
from scipy.stats import chisquare

from looplm.convert import convert
from looplm.models import LoopLMConfig, LoopLMForCausalLM, from_hf_model
from looplm.serve import Engine, ExitPolicy, Request, SamplingParams, make_scheduler, replay
from looplm.serve.context_index import ContextIndex
from looplm.serve.speculative import Speculator, accept_greedy, accept_sampled

models = engine_tests.models  # the engine tests' fixture: its models of every kind and plan


def prompts():
    """Random prompts, and prompts that repeat themselves (the context then drafts)."""
    g = torch.Generator().manual_seed(1)
    rand = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 1)]
    return rand + [[7, 8, 9, 10] * 3, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4, 1, 5], [42, 42, 42]]


def serve(model, ps, lens, speculate, max_batch=3, **kw):
    """Speculative rounds by the scheduler's name, as `looplm serve --speculate MODE` asks for them."""
    engine = Engine(model, max_batch=max_batch, max_seq_len=64)
    reqs = [Request(p, n, **kw) for p, n in zip(ps, lens)]
    sched = make_scheduler(f"speculative:{speculate}", engine)
    assert sched.name == "speculative"
    arrive_one_per_step(sched, reqs)
    return engine, reqs, sched.speculator


MODES = {"vanilla": ["context", "both"]}


@pytest.mark.parametrize(
    "name,mode",
    [
        (n, m)
        for n in ["vanilla", "recursive", "relaxed", "relaxed4", "gemma_relaxed", "middle", "coda"]
        for m in MODES.get(n, ["context", "loop1", "both"])
    ],
)
def test_greedy_speculation_equals_full_depth_greedy(models, name, mode):
    """Requests arriving mid-flight (batch up to 3): the tokens are full-depth greedy decoding's, drafts were both
    accepted and rejected (so rollback ran), and every cache row came back."""
    model, ps = models[name], prompts()
    lens = [12, 9, 14, 16, 10, 12]
    want = [full_depth_greedy(model, p, n) for p, n in zip(ps, lens)]
    engine, reqs, speculator = serve(model, ps, lens, mode)
    assert [r.output for r in reqs] == want
    assert all(r.status == "done" for r in reqs)
    assert engine.cache.free_rows == engine.cache.num_rows
    s = speculator.stats
    assert 0 < s["accepted"] < s["drafted"], s
    # finished requests keep their counts (for `generate --json`), not their context index
    assert not speculator.states and sum(speculator.state_of(r).drafted for r in reqs) == s["drafted"]
    assert all(set(r.exit_loops) == {model.config.num_loops} for r in reqs)  # every token verified at full depth


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_both_sources_at_batch_1(family):
    """Every family converted to B = 2 with LoRA, one request at a time (batch 1): the same tokens as full-depth
    greedy decoding."""
    model = convert(from_hf_model(make_hf_model(family)), loops=2, init="average", lora_ranks=4, norms="per-depth")
    ps = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 1, 2, 3]]
    want = [full_depth_greedy(model.eval(), [t % 128 for t in p], 14) for p in ps]
    engine = Engine(model, max_batch=1, max_seq_len=48)
    reqs = [Request([t % 128 for t in p], 14) for p in ps]
    sched = make_scheduler("speculative:both", engine)
    replay(sched, reqs)
    assert [r.output for r in reqs] == want
    assert sched.speculator.stats["drafted"] > 0


def test_modes_refused_where_they_cannot_work(models):
    with pytest.raises(ValueError, match="one loop"):
        Speculator(Engine(models["vanilla"]), "loop1")
    with pytest.raises(ValueError, match="exit policy"):
        Speculator(Engine(models["relaxed"], exit_policy=ExitPolicy("margin", 0.5)), "context")
    with pytest.raises(ValueError, match="unknown speculation mode"):
        make_scheduler("speculative:maybe", Engine(models["relaxed"]))


def test_context_drafts_copy_the_last_occurrence_of_the_longest_ngram():
    d = ContextIndex([1, 2, 3, 9, 2, 3, 8, 5, 2, 3], min_n=1)
    assert d.draft(2) == [8, 5]  # "2 3" last occurred before "8 5"; "3" alone would also say 8
    d = ContextIndex([1, 2, 3, 4, 7, 2, 3, 4, 6, 3, 4], min_n=1)
    assert d.draft(1) == [6] and d.guess == 6  # the last occurrence wins; the exits' copy guess is the first draft
    d.extend([5])
    assert d.draft(3) == [] and d.guess == -1  # "4 5", "5" never occurred
    d = ContextIndex([4, 7, 4, 7, 4], min_n=1)
    assert d.draft(5) == [7, 4, 7, 4, 7]  # a copy that reaches the end runs on into its own drafts
    assert ContextIndex([1, 2, 3], min_n=1).draft(4) == []


def test_accept_greedy_takes_the_agreeing_prefix_and_the_verifiers_token():
    assert accept_greedy([5, 6, 7], [5, 6, 1, 2]) == [5, 6, 1]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 2]) == [5, 6, 7, 2]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 2]) == [4]
    assert accept_greedy([5, 6], [5, 6]) == [5, 6]  # loop-1 drafts: no row after the last draft
    assert accept_greedy([], [3]) == [3]


def test_kv_rollback_leaves_exactly_the_committed_tokens(models):
    """After every round, the cache row holds the committed tokens' keys/values (those plain decoding leaves) and
    zeros from the pending token on, at every depth, although rejected drafts were written there."""
    model = models["relaxed"]
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4, 1, 5], 24
    plain = Engine(model, max_batch=1, max_seq_len=64)
    ref = Request(prompt, n)
    replay(make_scheduler("sequence", plain), [ref])
    engine = Engine(model, max_batch=1, max_seq_len=64)
    req = Request(prompt, n)
    sched = make_scheduler("speculative:both", engine)
    stats = sched.speculator.stats
    sched.submit(req)
    P, rejected_rounds, checked = engine.cache.prefix_len, 0, 0
    while sched.has_work():
        before = stats["drafted"] - stats["accepted"]
        sched.step()
        if req.status != "running":
            break
        rejected_rounds += stats["drafted"] - stats["accepted"] > before
        pending = len(req.prompt) + len(req.output) - 1
        for cache, ref_cache in ((engine.cache.k, plain.cache.k), (engine.cache.v, plain.cache.v)):
            torch.testing.assert_close(cache[:, :, : P + pending], ref_cache[:, :, : P + pending], rtol=1e-4, atol=1e-4)
            assert not cache[:, :, P + pending :].any()
        checked += 1
    assert req.output == ref.output
    assert rejected_rounds > 0 and checked > 3


def test_speculative_sampling_rule_draws_the_target_distribution():
    """accept_sampled, with a draft drawn from q: the first committed token has distribution p[0], and the second,
    given the first draft accepted, p[1] (chi-square, 20,000 seeded draws, vocabulary 8)."""
    g = torch.Generator().manual_seed(0)
    V, n = 8, 20000
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        d0 = int(torch.multinomial(q[0], 1, generator=g))
        d1 = int(torch.multinomial(q[1], 1, generator=g))
        out = accept_sampled([d0, d1], q, p, g)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chisquare(first, p[0] * n).pvalue > 1e-3
    assert chisquare(second, p[1] * second.sum()).pvalue > 1e-3
    # a certain draft (the context's: q one-hot) follows the same rule
    onehot = torch.zeros(1, V)
    onehot[0, 3] = 1
    counts = torch.zeros(V)
    for _ in range(5000):
        counts[accept_sampled([3], onehot, p[:2], g)[0]] += 1
    assert chisquare(counts, p[0] * 5000).pvalue > 1e-3


@pytest.fixture(scope="module")
def tiny_vocab_model():
    torch.manual_seed(3)
    cfg = {**TINY, "vocab_size": 8, "initializer_range": 0.1}
    vanilla = LoopLMForCausalLM(LoopLMConfig(**cfg)).eval()
    return convert(vanilla, loops=2, init="stepwise", lora_ranks=4, norms="per-depth").eval()


@pytest.mark.parametrize("mode", ["context", "loop1"])
def test_sampled_output_has_the_models_distribution(tiny_vocab_model, mode):
    """Three sampled tokens after a repeating prompt, 2,048 seeded requests served 64 at a time with speculation:
    their joint frequencies match the model's own distribution (softmax at temperature 0.9 over top-k 6, each token
    given the ones before, enumerated exactly), by chi-square."""
    model, prompt, n_tok = tiny_vocab_model, [1, 2, 3, 1, 2, 3, 1, 2], 3
    sp = dict(temperature=0.9, top_k=6)
    from looplm.serve.sampling import filtered_probs

    with torch.no_grad():  # exact joint distribution of the 3 tokens: every prefix through the model
        joint = torch.ones(1)
        seqs = torch.tensor([prompt])
        for _ in range(n_tok):
            logits = model(seqs).logits[:, -1]
            probs = filtered_probs(logits, [SamplingParams(**sp)] * len(seqs))
            joint = (joint[:, None] * probs).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(8, 0), torch.arange(8).repeat(len(seqs))[:, None]], 1)
    counts = torch.zeros(8**n_tok)
    engine, drafted, accepted = Engine(model, max_batch=64, max_seq_len=16), 0, 0
    for batch in range(32):
        reqs = [Request(prompt, n_tok, SamplingParams(**sp, seed=batch * 64 + i)) for i in range(64)]
        sched = make_scheduler(f"speculative:{mode}", engine)
        replay(sched, reqs)
        drafted, accepted = drafted + sched.speculator.stats["drafted"], accepted + sched.speculator.stats["accepted"]
        for r in reqs:
            counts[(r.output[0] * 8 + r.output[1]) * 8 + r.output[2]] += 1
    assert 0 < accepted < drafted
    n = counts.sum()
    expected = joint * n
    big = expected >= 5  # cells expected fewer than 5 times are pooled into one
    f_obs = torch.cat([counts[big], counts[~big].sum()[None]])
    f_exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert big.sum() > 20
    assert chisquare(f_obs, f_exp).pvalue > 1e-3


@pytest.mark.real
def test_generate_cli_speculate_reports_acceptance(tmp_path, capsys, smollm2_tokenizer):
    """`generate --speculate both --json`: the same token ids as without speculation, tokens/s, the acceptance rate
    and the mean accepted length; with an exit policy it is a usage error."""
    from looplm.commands import main
    from looplm.models import save_model

    tok = smollm2_tokenizer
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**{**TINY, "vocab_size": len(tok)})).eval()
    path = save_model(convert(vanilla, loops=2, init="stepwise", lora_ranks=8), tok, tmp_path / "looped")
    args = ["generate", str(path), "one two one two one two one", "--max-new-tokens", "16", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--speculate", "both"]) == 0
    spec = json.loads(capsys.readouterr().out)
    ids = spec["results"][0]["token_ids"]
    assert ids == plain["results"][0]["token_ids"] and len(ids) == spec["results"][0]["tokens"] > 0
    assert spec["tokens_per_second"] > 0 and "speculation" not in plain
    s = spec["speculation"]
    assert s["mode"] == "both" and s["drafted"] > 0 and s["acceptance_rate"] == round(s["accepted"] / s["drafted"], 4)
    assert s["mean_accepted_length"] >= 1
    assert main([*args, "--speculate", "context", "--exit-policy", "margin:0.5"]) == 2
    assert "use one or the other" in capsys.readouterr().err


@pytest.mark.real
def test_smollm2_greedy_with_context_drafts_equals_plain_decoding(smollm2):
    """The real SmolLM2-135M (B = 1: context drafts only): the same 48 greedy tokens as plain decoding, which the
    engine tests hold equal to full-depth greedy decoding."""
    model, tok, _ = smollm2
    prompts = [
        tok("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", add_special_tokens=False)["input_ids"],
        tok("The capital of France is", add_special_tokens=False)["input_ids"],
    ]
    outs = {}
    for scheduler in ("sequence", "speculative:context"):
        sched = make_scheduler(scheduler, Engine(model, max_batch=2, max_seq_len=128))
        reqs = [Request(p, 48) for p in prompts]
        replay(sched, reqs)
        outs[scheduler] = [r.output for r in reqs]
    assert sched.speculator.stats["accepted"] > 0
    assert outs["speculative:context"] == outs["sequence"]


def test_server_metrics_report_acceptance():
    from looplm.serve.metrics import Metrics

    m = Metrics(2)
    assert "looplm_speculative_acceptance_rate 0" in m.render()
    m.speculation({"drafted": 40, "accepted": 30, "rounds": 12, "tokens": 42})
    text = m.render()
    assert "looplm_speculative_drafted_tokens_total 40" in text
    assert "looplm_speculative_accepted_tokens_total 30" in text
    assert "looplm_speculative_verifications_total 12" in text
    assert "looplm_speculative_acceptance_rate 0.75" in text


@pytest.mark.real
def test_http_server_speculating_gives_the_same_completion_and_reports_acceptance(smollm2_tokenizer):
    """`looplm serve --speculate both` (the scheduler ``speculative:both``): the OpenAI completion is the one plain
    greedy decoding gives, and /metrics counts drafted and accepted tokens."""
    import urllib.request

    from conftest import serve_in_thread

    tok = smollm2_tokenizer
    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**{**TINY, "vocab_size": len(tok)})).eval()
    model = convert(vanilla, loops=2, init="stepwise", lora_ranks=8, norms="per-depth").eval()
    prompt = tok("one two one two one two one", add_special_tokens=False)["input_ids"]
    plain = Engine(model, max_batch=1, max_seq_len=128)
    ref = Request(prompt, 20)
    replay(make_scheduler("sequence", plain), [ref])
    options = dict(max_concurrency=2, max_queue=4, max_seq_len=128, scheduler="speculative:both")
    with serve_in_thread(model, tok, "spec", **options) as (url, _):
        body = json.dumps({"model": "spec", "prompt": prompt, "max_tokens": 20, "temperature": 0}).encode()
        post = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(post, timeout=120) as r:
            out = json.loads(r.read())
        with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
    assert out["choices"][0]["text"] == tok.decode(ref.output)
    assert out["usage"]["completion_tokens"] == len(ref.output)
    drafted = int(re.search(r"^looplm_speculative_drafted_tokens_total (\d+)", metrics, re.M).group(1))
    accepted = int(re.search(r"^looplm_speculative_accepted_tokens_total (\d+)", metrics, re.M).group(1))
    assert drafted > 0 and 0 <= accepted <= drafted
