"""`looplm bench serve --json` and `looplm generate` end to end on a tiny random model that uses the
real SmolLM2 tokenizer (the trace is cut from real text)."""

import json

import pytest
import torch
from conftest import tiny_model

from looplm.commands import main

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from looplm.models import load_model, save_model

    _, tok = load_model("smollm2-135m")
    model = tiny_model(vocab_size=len(tok), initializer_range=0.02)  # LoopLMConfig's default initialisation
    return save_model(model, tok, tmp_path_factory.mktemp("m") / "tiny")


def small_bench(tiny_dir) -> list[str]:
    """`looplm bench serve` on the tiny model at its smallest: two requests arriving at once, no exit table, no
    hypothetical simulation."""
    return [
        *("bench", "serve", str(tiny_dir), "--requests", "2", "--prompt-len", "4:8", "--output-len", "2:3"),
        *("--max-concurrency", "2", "--arrivals", "all", "--tradeoff-tokens", "0", "--lora-rank", "8"),
        *("--sim-samples", "0", "--allow-unhealed", "--json"),
    ]


def test_bench_serve_json(tiny_dir, capsys):
    rc = main(
        [
            "bench",
            "serve",
            str(tiny_dir),
            "--requests",
            "4",
            "--prompt-len",
            "4:12",
            "--output-len",
            "2:6",
            "--max-concurrency",
            "2",
            "--arrivals",
            "all,poisson",
            "--exit-policy",
            "softmax:0.0",
            "--tradeoff-tokens",
            "64",
            "--lora-rank",
            "8",
            "--sim-samples",
            "2",
            "--sim-prefix",
            "8",
            "--sim-decode",
            "8",
            "--sim-max-batch",
            "4",
            "--allow-unhealed",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["schedulers"]) == {"static", "sequence", "depth"}
    for fig in out["schedulers"].values():
        for key in ("tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "peak_rss_mb"):
            assert isinstance(fig[key], float) and fig[key] > 0, key
    assert out["agreement"] == out["runs"]["depth"]["agreement"]  # the headline is the depth-wise run's
    # softmax:0 makes every decode token exit after loop 1
    assert out["runs"]["depth"]["exits_per_loop"][0] > 0
    hyp = out["hypothetical"]
    assert hyp["delta_v"] > 0 and hyp["delta_seq"] > 0
    assert sum(hyp["oracle_exits_per_loop"]) == 2 * 8  # two held-out windows of 8 decoded tokens
    assert hyp["vanilla"]["max_batch"] <= hyp["looped"]["max_batch"] <= 4
    assert set(out["poisson"]["schedulers"]) == {"static", "sequence", "depth"}
    assert out["runs"]["static"]["tokens"] == out["runs"]["sequence"]["tokens"] == out["runs"]["depth"]["tokens"]


def test_bench_serve_without_the_exit_table(tiny_dir, capsys):
    rc = main(small_bench(tiny_dir))
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        "exit_tradeoff" not in out
        and "hypothetical" not in out
        and set(out["schedulers"]) == {"static", "sequence", "depth"}
    )


def test_bench_serve_bad_args(tiny_dir, capsys):
    with pytest.raises(SystemExit) as refused:  # the parser refuses it, naming the flag and its choices
        main(["bench", "serve", str(tiny_dir), "--arrivals", "sometimes"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--arrivals" in err and "all, poisson" in err


def _greedy(model, tok, prompt: str, new_tokens: int) -> str:
    """Greedy decoding by hand: the whole sequence through the model for each token, no cache, no engine."""
    ids = tok(prompt, add_special_tokens=bool(model.config.add_bos_token))["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
    return tok.decode(out)


def test_generate_cli(tiny_dir, capsys, tmp_path):
    """`generate` with two prompts of different lengths in one batch gives each the text greedy decoding gives."""
    from looplm.models import load_model, save_model

    model, tok = load_model(tiny_dir)
    torch.manual_seed(1)
    with torch.no_grad():  # larger weights than the init's: greedy text that changes token by token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    varied = save_model(model, tok, tmp_path / "varied")
    prompts = ["Hello", "Once upon a time, in a land far away"]
    assert main(["generate", str(varied), *prompts, "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["results"]
    texts = [_greedy(model.eval(), tok, prompt, 6) for prompt in prompts]
    assert all(len(set(tok(t)["input_ids"])) > 3 for t in texts)  # not one token repeated
    assert [r["status"] for r in out] == ["done", "done"] and [r["text"] for r in out] == texts
    assert main(["generate", str(tiny_dir), "Hello", "--max-new-tokens", "0", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["status"] == "error" and "max_tokens" in out["results"][0]["error"]


def test_weights_flag_quantizes_and_reports_memory(tiny_dir, capsys):
    from looplm.models.quantized import supported_formats

    if "int8" not in supported_formats("cpu"):
        pytest.skip("this torch build cannot run int8 weights on CPU")
    flags = small_bench(tiny_dir)
    figs = {}
    for fmt in ("fp32", "int8"):
        assert main(flags + ["--weights", fmt]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["weights"] == {"vanilla": fmt, "looped": fmt} and out["looped_lora"] == "shared"
        figs[fmt] = out["runs"]
    assert main(flags + ["--weights", "int8", "--lora", "merged"]) == 0  # the looped model's LoRA merged per depth
    assert json.loads(capsys.readouterr().out)["looped_lora"] == "merged"
    # the vocabulary-sized embedding dominates this tiny model: int8 rows without a packed copy
    assert figs["int8"]["static"]["weights_mb"] * 3 < figs["fp32"]["static"]["weights_mb"]
    assert figs["int8"]["static"]["packed_weights_mb"] == 0
    assert main(["generate", str(tiny_dir), "Hello", "--max-new-tokens", "3", "--weights", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "done"
    with pytest.raises(SystemExit) as e:  # argparse's own check: one line, exit code 2
        main(["generate", str(tiny_dir), "Hello", "--weights", "int5"])
    assert e.value.code == 2


def test_compile_flag_gives_the_eager_tokens_and_fails_cleanly_without_a_compiler(tiny_dir, capsys, monkeypatch):
    import shutil

    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    gen = ["generate", str(tiny_dir), "Hello there", "--max-new-tokens", "4", "--json"]
    outs = []
    for extra in ([], ["--compile"]):
        assert main(gen + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["results"][0]["text"])
    assert outs[0] == outs[1]
    from looplm import util

    monkeypatch.setattr(util.shutil, "which", lambda name: None)
    assert main(gen + ["--compile"]) == 2
    assert "C++ compiler" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir), "--compile"]) == 2  # checked before the model loads
    assert "C++ compiler" in capsys.readouterr().err


def test_agreement_counts_the_tokens_equal_to_full_depth_greedy(tiny_dir):
    """bench serve's agreement: the share of generated tokens equal to what the full-depth model picks greedily
    after the same prefix, checked on outputs built to agree on a known share of their tokens."""
    import types

    from looplm.bench.serving import agreement
    from looplm.models import load_model

    model, tok = load_model(tiny_dir)
    torch.manual_seed(2)
    with torch.no_grad():  # weights that make the greedy choice change token by token
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.eval()

    def continuation(prompt: list[int], pattern: str) -> list[int]:
        out = []
        for keep in pattern:  # "y": the greedy token, "n": another one
            with torch.no_grad():
                best = int(model(torch.tensor([prompt + out])).logits[0, -1].argmax())
            out.append(best if keep == "y" else (best + 1) % model.config.vocab_size)
        return out

    a, b = tok("Hello there")["input_ids"], tok("Once upon a time")["input_ids"]
    reqs = [
        types.SimpleNamespace(prompt=a, output=continuation(a, "yyyy")),
        types.SimpleNamespace(prompt=b, output=continuation(b, "ynyn")),
        types.SimpleNamespace(prompt=b, output=[]),  # a request that generated nothing counts for nothing
    ]
    assert agreement(model, reqs) == pytest.approx(6 / 8)
    assert agreement(model, reqs[1:2]) == pytest.approx(2 / 4)
