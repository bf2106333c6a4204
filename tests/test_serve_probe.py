"""The learned exit probe: the logistic fit, `looplm fit-exit-probe` on a tiny model and corpus, the
`probe` policy in the engine (its decisions are the probe's, from the engine's own hidden states),
and its errors."""

import json

import pytest
import torch
from test_train_fixtures import build_corpus, make_models

from looplm.bench.serving import exit_tradeoff
from looplm.commands import main
from looplm.models import load_model
from looplm.serve import Engine, ExitPolicy, Request, make_scheduler, replay
from looplm.serve.probe import PROBE_FILE, ExitProbe, ProbeError, fit_logistic, probe_features


def test_fit_logistic_learns_a_rule_on_unscaled_features():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 5, generator=g) * torch.tensor([100.0, 1.0, 0.01, 5.0, 1.0]) + 3.0
    y = (x[:, 2] - 3.0) * 100 + (x[:, 1] - 3.0) > 0  # features at very different scales
    w, b = fit_logistic(x[:3000], y[:3000])
    pred = torch.sigmoid(x[3000:] @ w + b) >= 0.5
    assert (pred == y[3000:]).float().mean() > 0.97
    assert w[0].abs() * 100 < w[2].abs() * 0.01  # the irrelevant large feature gets a tiny weight


def fit_probe(model_dir, corpus, *options) -> None:
    """`looplm fit-exit-probe` of ``model_dir`` on 12 rows of ``corpus``, its threshold set on 6 more for 90%
    agreement; it succeeds."""
    argv = [model_dir, "--data", corpus, "--fit-rows", 12, "--calib-rows", 6, "--target-agreement", 0.9]
    assert main(["fit-exit-probe", *map(str, argv), *options, "--json"]) == 0


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    models = make_models(tmp)
    corpus = build_corpus(tmp, models["recursive"])
    fit_probe(models["recursive"], corpus)
    return models, corpus


def test_fit_writes_probe_and_report(fitted, capsys):
    models, _ = fitted
    d = models["recursive"]
    probe = ExitProbe.load(d / PROBE_FILE)
    assert probe.weight.shape == (1, 64 + 1) and probe.bias.shape == (1,)
    report = json.loads((d / "eval" / "exit_probe.json").read_text())
    assert report["threshold"] == probe.threshold and 0 < probe.threshold < 1
    assert report["fit_tokens"] == 12 * 32 and report["calib_tokens"] == 6 * 32
    at = report["calib_at_threshold"]
    # the calibrated threshold meets the target on the calibration rows, and is the lowest that does (the most
    # exits): every lower threshold of the report's curve misses it
    assert at["threshold"] == probe.threshold < 0.99 and at["agreement"] >= 0.9
    lower = [p for p in report["curve"] if p["threshold"] < probe.threshold]
    assert lower and all(p["agreement"] < 0.9 for p in lower)
    assert at["early_exit_fraction"] >= max(p["early_exit_fraction"] for p in report["curve"] if p["agreement"] >= 0.9)


def _serve(model, policy, prompts, n=6):
    engine = Engine(model, max_batch=3, max_seq_len=64, exit_policy=policy)
    reqs = [Request(p, n) for p in prompts]
    replay(make_scheduler("depth", engine), reqs)
    return engine, reqs


def test_probe_policy_in_the_engine(fitted):
    models, _ = fitted
    model, _ = load_model(models["recursive"])
    prompts = [[5, 80, 101, 32], [72, 101, 108, 108, 111], [33] * 9]
    full = _serve(model, ExitPolicy("none"), prompts)[1]
    # threshold 0: every decode token exits after loop 1, exactly like softmax:0 (which decides from logits)
    e0, r0 = _serve(model, ExitPolicy("probe", 0.0), prompts)
    s0 = _serve(model, ExitPolicy("softmax", 0.0), prompts)[1]
    assert [r.output for r in r0] == [r.output for r in s0]
    assert e0.stats["exits_per_loop"][0] == sum(len(r.output) - 1 for r in r0)
    # above 1 nothing exits: full depth
    assert [r.output for r in _serve(model, ExitPolicy("probe", 1.01), prompts)[1]] == [r.output for r in full]
    # the default threshold is the calibrated one, and each exit is the probe's decision on that token's
    # hidden states: checked teacher-forced up to a request's first early exit (until then its KV is exact)
    engine, reqs = _serve(model, ExitPolicy("probe"), prompts, n=12)
    assert engine.policy.threshold == engine.policy.probe.threshold
    _check_probe_decisions(model, engine, prompts, reqs, lambda states, h0: probe_features(model, states[0][0], h0))
    assert 0 < engine.stats["exits_per_loop"][0]


def _check_probe_decisions(model, engine, prompts, reqs, features):
    """Each early exit the engine took is the probe's decision on that token's loop-1 features
    (``features(loop states, embeddings)``), checked teacher-forced up to a request's first early exit
    (until then its KV is exact)."""
    probe, thr, checked = engine.policy.probe, engine.policy.threshold, 0
    with torch.no_grad():
        for p, r in zip(prompts, reqs):
            ids = torch.tensor([p + r.output[:-1]])
            _, states, _ = model.model(ids, output_loop_states=True)
            pr = probe.prob(features(states, model.model.embed(ids)[0]), torch.zeros(ids.shape[1], dtype=torch.long))
            for k in range(1, len(r.output)):  # output k is decided at position len(p) + k - 1
                q = float(pr[len(p) + k - 1])
                if abs(q - thr) > 1e-4:
                    assert (r.exit_loops[k] == 1) == (q >= thr), (k, q, thr)
                    checked += 1
                if r.exit_loops[k] == 1:
                    break
    assert checked >= len(prompts)


def test_tradeoff_table_has_probe_rows(fitted):
    models, _ = fitted
    model, _ = load_model(models["recursive"])
    trade = exit_tradeoff(model, list(range(40, 140)), n_tokens=64, seq_len=32)
    rows = [r for r in trade["policies"] if r["policy"].startswith("probe:")]
    assert len(rows) >= 3 and all(0 <= r["early_exit_fraction"] <= 1 for r in rows)


def test_probe_errors(fitted, tmp_path, capsys):
    models, corpus = fitted
    student, _ = load_model(models["student"])  # no probe saved beside it
    with pytest.raises(ProbeError, match="fit-exit-probe"):
        Engine(student, exit_policy=ExitPolicy("probe"))
    bad = ExitProbe(torch.zeros(2, 65), torch.zeros(2), 0.5, {})
    with pytest.raises(ProbeError, match="another model"):
        bad.check(student)
    assert main(["fit-exit-probe", str(tmp_path), "--data", str(corpus)]) == 2
    assert "not a saved looplm model" in capsys.readouterr().err
    assert main(["fit-exit-probe", str(models["teacher"]), "--data", str(corpus)]) == 2
    assert "B = 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fitted_confidence(fitted, tmp_path_factory):
    """The same tiny model with a probe on the logits' confidence features (a copy: the hidden-state
    probe of `fitted` stays where the other tests read it)."""
    import shutil

    models, corpus = fitted
    d = tmp_path_factory.mktemp("probe_conf") / "recursive"
    shutil.copytree(models["recursive"], d)
    fit_probe(d, corpus, "--features", "confidence")
    return d


def test_confidence_probe_in_the_engine(fitted_confidence):
    from looplm.serve.probe import confidence_features

    d = fitted_confidence
    probe = ExitProbe.load(d / PROBE_FILE)
    assert probe.features == "confidence" and probe.weight.shape == (1, 9) and probe.needs_logits
    assert json.loads((d / "eval" / "exit_probe.json").read_text())["features"] == "confidence"
    model, _ = load_model(d)
    assert ExitPolicy("probe").bind(model).needs_logits
    prompts = [[5, 80, 101, 32], [72, 101, 108, 108, 111], [33] * 9]
    e0, r0 = _serve(model, ExitPolicy("probe", 0.0), prompts)
    assert [r.output for r in r0] == [r.output for r in _serve(model, ExitPolicy("softmax", 0.0), prompts)[1]]
    # each decision is the probe's, on the loop-1 logits and states of that token
    engine, reqs = _serve(model, ExitPolicy("probe"), prompts, n=12)
    _check_probe_decisions(
        model,
        engine,
        prompts,
        reqs,
        lambda states, h0: confidence_features(model.exit_logits(states[0][0]), states[0][0], h0),
    )


def test_confidence_features_and_old_probe_files(tmp_path):
    from safetensors.torch import save_file

    from looplm.serve.probe import confidence_features

    logits = torch.tensor([[4.0, 2.0, 0.0, -1.0, -2.0, -3.0], [0.0] * 6])
    h, h_prev = torch.ones(2, 3), torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    f = confidence_features(logits, h, h_prev)
    p = logits.softmax(-1)
    assert f.shape == (2, 9)
    assert torch.allclose(f[0, :5], p[0, :5]) and torch.allclose(f[0, 5], p[0, 0] - p[0, 1])
    assert torch.allclose(f[1, 6], -torch.log(torch.tensor(6.0)))  # uniform: entropy log V
    assert f[0, 7] == 2.0 and f[1, 7] == 0.0 and torch.allclose(f[:, 8], torch.tensor([1.0, -1.0]))
    assert confidence_features(logits[:, :3], h, h_prev)[:, 3:5].abs().sum() == 0  # V < 5: padded
    # a probe file from before the feature sets existed is a hidden-state probe
    save_file(
        {"weight": torch.zeros(1, 65), "bias": torch.zeros(1)},
        str(tmp_path / PROBE_FILE),
        metadata={"threshold": "0.7", "meta": "{}"},
    )
    old = ExitProbe.load(tmp_path / PROBE_FILE)
    assert old.features == "hidden" and not old.needs_logits and old.threshold == 0.7
