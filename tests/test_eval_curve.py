"""`looplm eval curve`: quality against healing tokens, the power law fitted to it and what it implies, on suite
results built with a known answer; the healing tokens a suite row records from the run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from looplm.commands import main
from looplm.errors import UsageError
from looplm.eval.curve import build_curve
from looplm.eval.suite import heal_tokens

A, B = 40.0, 0.3  # log-ratio = A * tokens^-B
TOKENS = (200_000, 400_000, 800_000, 1_600_000)


def result_file(path: Path, tokens, noise=(0.0, 0.0, 0.0, 0.0), windows: int = 16, se: float = 0.02) -> str:
    """A suite result whose healed rows lie on the power law (times exp(noise)), each with its standard error."""
    rows = [{"name": "original", "model": "smollm2-135m", "ood_ratio": 1.0, "tasks": {"lambada": {"value": 0.34}}}]
    for t, n in zip(tokens, noise):
        log_ratio = A * t**-B * math.exp(n)
        ratio = math.exp(log_ratio)
        rows.append(
            {
                "name": f"t{t}",
                "model": f"out/heal-{t}/final",
                "heal_tokens": t,
                "ood_ratio": ratio,
                "in_domain_ratio": 1.3,
                "ood_ratio_stats": {
                    "log": log_ratio,
                    "log_se": se,
                    "ratio": ratio,
                    "ratio_low": math.exp(log_ratio - 2 * se),
                    "ratio_high": math.exp(log_ratio + 2 * se),
                },
                "tasks": {"lambada": {"value": 0.1, "stderr": 0.02}},
            }
        )
    settings = {"reference": "smollm2-135m", "domains": ["fiction"], "windows": windows, "seq_len": 512}
    path.write_text(json.dumps({**settings, "rows": rows}))
    return str(path)


def test_an_exact_power_law_is_recovered_with_the_tokens_it_implies(tmp_path):
    curve = build_curve([result_file(tmp_path / "r.json", TOKENS)])
    fit = curve["fit"]
    assert fit["b"] == pytest.approx(B, rel=1e-6) and fit["a"] == pytest.approx(A, rel=1e-6)
    assert fit["b_low"] < B < fit["b_high"]
    for target in curve["targets"]:
        expected = (math.log(target["ratio"]) / A) ** (-1 / B)
        assert target["tokens"] == pytest.approx(expected, rel=1e-6)
        assert target["low"] < expected < target["high"]
    assert [p["heal_tokens"] for p in curve["points"]] == list(TOKENS)


def test_scatter_about_the_line_widens_the_interval(tmp_path):
    exact = build_curve([result_file(tmp_path / "a.json", TOKENS)])
    noisy = build_curve([result_file(tmp_path / "b.json", TOKENS, noise=(0.1, -0.1, 0.1, -0.1))])
    width = lambda c: c["fit"]["b_high"] - c["fit"]["b_low"]  # noqa: E731
    assert noisy["fit"]["reduced_chi2"] > 1 and width(noisy) > 2 * width(exact)
    # the band holds the fitted line and is wider where the scatter is
    band, f = noisy["band"], noisy["fit"]
    line = np.exp(f["a"] * np.array(band["tokens"]) ** -f["b"])
    assert np.all(np.array(band["low"]) <= line) and np.all(line <= np.array(band["high"]))
    spread = lambda c: np.array(c["band"]["high"]) / np.array(c["band"]["low"])  # noqa: E731
    assert np.all(spread(noisy) >= spread(exact))


def test_points_from_several_files_scored_alike_make_one_curve(tmp_path):
    first = result_file(tmp_path / "a.json", TOKENS[:2])
    second = result_file(tmp_path / "b.json", TOKENS[2:])
    curve = build_curve([second, first])
    assert [p["heal_tokens"] for p in curve["points"]] == list(TOKENS)
    assert curve["fit"]["b"] == pytest.approx(B, rel=1e-6)


def test_files_scored_otherwise_or_rows_without_tokens_are_refused(tmp_path):
    first = result_file(tmp_path / "a.json", TOKENS[:2])
    other = result_file(tmp_path / "b.json", TOKENS[2:], windows=32)
    with pytest.raises(UsageError, match="windows"):
        build_curve([first, other])
    bare = json.loads(Path(result_file(tmp_path / "c.json", TOKENS)).read_text())
    del bare["rows"][1]["heal_tokens"]
    (tmp_path / "c.json").write_text(json.dumps(bare))
    with pytest.raises(UsageError, match="tokens are unknown"):
        build_curve([str(tmp_path / "c.json")])
    with pytest.raises(UsageError, match="at least 3"):
        build_curve([first])


def test_a_suite_row_records_the_heal_tokens_of_its_run(tmp_path):
    run = tmp_path / "heal"
    (run / "final").mkdir(parents=True)
    (run / "heal.json").write_text(json.dumps({"tokens": 118784, "local_tokens": 2924544}))
    (run / "run.json").write_text(json.dumps({"plan": {"local_tokens_per_layer": 208896}}))
    assert heal_tokens(str(run / "final")) == 118784 + 208896
    assert heal_tokens("smollm2-135m") is None


def test_the_command_writes_the_table_json_and_plot(tmp_path, capsys):
    path = result_file(tmp_path / "r.json", TOKENS, noise=(0.02, -0.01, 0.0, 0.01))
    assert main(["eval", "curve", path, "--out", str(tmp_path / "curve")]) == 0
    text = capsys.readouterr().out
    assert "| 1,600,000 |" in text and "1.3x" in text
    saved = json.loads((tmp_path / "curve.json").read_text())
    assert np.isfinite(saved["targets"][-1]["tokens"]) and (tmp_path / "curve.png").stat().st_size > 0
