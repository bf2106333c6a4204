"""`looplm bench`: each benchmark runs end to end on a tiny converted model and a small real-text corpus, prints
its table naming the CPU, and writes its JSON; llama.cpp's without the optional extra is one clear line."""

import importlib.util
import json

import pytest
from conftest import needs_wheel
from test_train_fixtures import build_corpus, make_models, ood_texts  # noqa: F401 (fixture)

from looplm.commands import main
from looplm.util import cpu_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread):
    tmp = tmp_path_factory.mktemp("bench")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


# a small trace: three requests of 4-8 prompt tokens and 2-4 new tokens, two at a time
TRACE = ["--requests", 3, "--prompt-len", "4:8", "--output-len", "2:4", "--max-concurrency", 2]


def run(capsys, *args):
    rc = main(["bench", *map(str, args)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out


def test_the_machine_is_named_with_its_widest_instructions(tmp_path):
    """Two parts of one model name (AMD EPYC with and without AVX-512) run our kernels at different speeds: the
    name a result carries tells them apart."""
    info = tmp_path / "cpuinfo"
    for flags, named in [
        ("fpu sse2 avx2 fma", "AMD EPYC (AVX2)"),
        ("avx2 avx512f avx512bw", "AMD EPYC (AVX-512)"),
        ("avx2 avx512f avx512_bf16", "AMD EPYC (AVX-512 BF16)"),
        ("avx512f avx512_bf16 amx_bf16 amx_tile", "AMD EPYC (AMX)"),
        ("fpu sse2", "AMD EPYC"),
    ]:
        info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
        assert cpu_model(str(info)).rsplit(",", 1)[0] == named


def test_serve(setup, tmp_path, capsys):
    _, models, _ = setup
    out = tmp_path / "serve.json"
    printed = run(
        capsys,
        *("serve", models["teacher"], "--looped", models["student"], *TRACE, "--arrivals", "all"),
        *("--exit-policy", "softmax:0.5", "--tradeoff-tokens", 0, "--sim-samples", 0, "--out", out),
    )
    result = json.loads(out.read_text())
    assert set(result["schedulers"]) == {"static", "sequence", "depth"}
    assert result["runs"]["depth"]["tokens_per_s"] > 0 and result["machine"]["cpu"] == cpu_model()
    assert cpu_model() in printed and "| depth | looped |" in printed


def heal_step(setup) -> list:
    """`looplm bench heal-step` on the fixture's student and original, small rows and batches, one round."""
    _, models, corpus = setup
    student = ["heal-step", models["student"], "--teacher", models["teacher"], "--data", corpus]
    return [*student, "--seq-len", 32, "--local-batch", 2, "--cache-rows", 4, "--rounds", 1]


def test_heal_step(setup, tmp_path, capsys):
    out = tmp_path / "heal.json"
    printed = run(capsys, *heal_step(setup), "--e2e-batch", 2, "--precision", "fp32", "--out", out)
    result = json.loads(out.read_text())
    assert set(result["steps"]) == {"local", "e2e", "exit"}
    assert all(s["seconds"] > 0 and len(s["rounds"]) == 1 for s in result["steps"].values())
    assert result["loops"] == 2 and result["precision"] == "fp32" and result["machine"]["cpu"] == cpu_model()
    assert "| local |" in printed and "| e2e |" in printed


def test_heal_step_without_an_exit_stage_from_cached_rows(setup, tmp_path, capsys):
    out, cache = tmp_path / "heal.json", tmp_path / "cache"
    run(capsys, *heal_step(setup), "--e2e-rows", "cache", "--exit-adapter", "none", "--cache", cache, "--out", out)
    assert set(json.loads(out.read_text())["steps"]) == {"local", "e2e"}
    assert cache.is_dir()  # kept where asked


def test_train_step(setup, tmp_path, capsys):
    _, models, corpus = setup
    out = tmp_path / "train.json"
    printed = run(
        capsys,
        *("train-step", models["student"], "--data", corpus, "--batch-size", 2, "--seq-len", 16),
        *("--steps", 3, "--warmup", 1, "--precision", "fp32", "--out", out),
    )
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["warmup"] == 1 and len(result["step_seconds"]) == 3
    assert result["seconds_per_step"] > 0 and result["global_batch"] * result["seq_len"] == 32
    assert cpu_model() in printed


def test_bad_arguments_are_one_line(setup, capsys):
    _, models, corpus = setup
    assert main(["bench", "train-step", str(models["student"]), "--data", str(corpus), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: an unknown weight format
        main(["bench", "llamacpp", "--weights", "int5"])
    assert e.value.code == 2


def test_llamacpp_without_the_extra_names_it(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert main(["bench", "llamacpp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e .[bench]" in err


class FakeLlamaCpp:
    """Stands in for llama.cpp where the extra is not installed: every output is the prompt's last token."""

    def __init__(self, path, threads, parallel, max_len):
        self.parallel = parallel

    def serve(self, trace):
        return [[r["prompt"][-1]] * r["max_tokens"] for r in trace], 0.01

    def close(self):
        pass


def test_llamacpp_flow_with_llama_cpp_stood_in(setup, tmp_path, capsys, monkeypatch):
    """Everything but llama.cpp itself: our formats (GPTQ-rounded, equalized), a looped model with exits at batch
    1, perplexity, agreement, ratios, the table and the JSON."""
    from looplm.bench import llamacpp
    from looplm.models.quantized import supported_formats

    _, models, corpus = setup
    monkeypatch.setattr(llamacpp, "check_available", lambda: None)
    monkeypatch.setattr(llamacpp, "LlamaCpp", FakeLlamaCpp)
    monkeypatch.setattr(llamacpp, "ggufs", lambda *a: {"llama.cpp q8_0": "fake.gguf"})
    formats = "fp32,int8" if "int8" in supported_formats("cpu") else "fp32"
    out = tmp_path / "llamacpp.json"
    printed = run(
        capsys,
        *("llamacpp", models["teacher"], "--weights", formats, "--b1-requests", 2, "--b1-new-tokens", 3, *TRACE),
        *("--llama-concurrency", "1,2", "--rounds", 2, "--data", corpus, "--scored-tokens", 64),
        *("--calib-data", corpus, "--calib-rows", 4, "--equalize", "--looped", models["student"]),
        *("--looped-weights", "fp32", "--exit-policy", "none,softmax:0.5", "--out", out),
    )
    r = json.loads(out.read_text())
    fp32 = r["configs"]["looplm fp32"]
    assert fp32["agreement_with_fp32"] == 1.0 and fp32["perplexity"] > 1 and len(fp32["batch1_rounds"]) == 2
    assert {"looped fp32 none", "looped fp32 softmax:0.5", "llama.cpp q8_0", "llama.cpp q8_0 x2"} <= set(r["configs"])
    assert r["configs"]["looped fp32 none"]["agreement_full_depth"] == 1.0
    assert set(r["ratios"]["trace"]) == {f"looplm {f} / llama.cpp q8_0" for f in formats.split(",")}
    assert r["machine"]["cpu"] == cpu_model() and "| looplm fp32 |" in printed


@pytest.mark.real
def test_llamacpp(tmp_path, capsys):
    needs_wheel("llama-cpp-python")
    out = tmp_path / "llamacpp.json"
    run(
        capsys,
        "llamacpp",
        "smollm2-135m",
        "--weights",
        "fp32,int8",
        "--b1-requests",
        1,
        "--b1-new-tokens",
        4,
        "--requests",
        2,
        "--output-len",
        4,
        "--max-concurrency",
        2,
        "--llama-concurrency",
        2,
        "--rounds",
        1,
        "--out",
        out,
    )
    result = json.loads(out.read_text())
    assert {"looplm fp32", "looplm int8", "llama.cpp q4", "llama.cpp q8_0"} <= set(result["configs"])
    assert result["configs"]["looplm fp32"]["agreement_with_fp32"] == 1.0


class FakeLlama:
    """Stands in for llama-cpp-python's ``Llama``: greedy output counts up from the prompt's last token; with a
    draft model, every round drafts the next three tokens, so the rounds are a third of the tokens."""

    def __init__(self, draft_model):
        self.draft_model = draft_model

    def generate(self, ids, temp, reset):
        assert temp == 0.0 and reset
        for i in range(10**6):
            if self.draft_model is not None and i % 3 == 0:
                self.draft_model.rounds += 1
                self.draft_model.drafted += 3
            yield ids[-1] + 1 + i


def test_speculate_side_by_side(setup, tmp_path, capsys, monkeypatch):
    """`bench speculate` on a vanilla and a looped model: every mode's greedy tokens equal plain decoding's, every
    row has its ratio to itself and to the vanilla model without speculation; llama.cpp (stood in) joins with
    its own rows, and every row gets its ratio to llama.cpp's plain decoding."""
    from looplm.bench import llamacpp, speculate

    _, models, _ = setup
    monkeypatch.setattr(llamacpp, "check_available", lambda: None)
    monkeypatch.setattr(
        speculate, "_llama_models", lambda *a: {"off": FakeLlama(None), "context": FakeLlama(FakeDraft())}
    )
    gguf = tmp_path / "vanilla.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "speculate.json"
    printed = run(
        capsys, "speculate", models["teacher"], models["student"], "--new-tokens", 12, "--llamacpp", gguf, "--out", out
    )
    assert cpu_model() in printed and "x llama.cpp off" in printed
    runs = json.loads(out.read_text())["runs"]
    ours = [r for r in runs if r["weights"] == "fp32"]
    looped = {r["speculate"] for r in ours if r["loops"] == 2}
    assert looped == {"off", "context", "loop1", "both"} and {r["speculate"] for r in ours if r["loops"] == 1} == {
        "off",
        "context",
        "both",
    }
    assert all(r["same_tokens_as_off"] and r["tokens"] == 12 for r in ours)
    assert all(r["vs_vanilla"] == 1.0 for r in ours if r["loops"] == 1 and r["speculate"] == "off")
    llama = [r for r in runs if r["weights"] == "gguf"]
    assert len(llama) == 6 and all("vs_vanilla" not in r for r in llama)
    assert all(r["vs_llamacpp"] == 1.0 for r in llama if r["speculate"] == "off")
    assert all("vs_llamacpp" in r and "vs_vanilla" in r for r in ours)
    lookup = [r for r in llama if r["speculate"] == "context"]
    assert all(
        r["mean_accepted_length"] == 3.0 and r["acceptance_rate"] == pytest.approx(2 / 3, abs=1e-3) for r in lookup
    )


class FakeDraft:
    rounds = drafted = 0


def test_speculate_refuses_a_missing_gguf(setup, capsys, monkeypatch):
    from looplm.bench import llamacpp

    _, models, _ = setup
    monkeypatch.setattr(llamacpp, "check_available", lambda: None)
    assert main(["bench", "speculate", str(models["teacher"]), "--llamacpp", "no-such.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such.gguf: no such GGUF file" in err
