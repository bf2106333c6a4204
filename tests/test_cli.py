"""The `looplm` command end to end on a small checkpoint: convert, info, eval ppl, and bad input
(exit code 2, a one-line error, no half-written output)."""

import json
import math

import pytest
import torch
from conftest import run_cli as run


def _reference_perplexity(model, tokenizer, n_tokens: int) -> float:
    """Perplexity of the first ``n_tokens`` next-token predictions on the shipped held-out sample, worked out
    from one plain forward pass (no windows, batches or loop exits: not the code under test)."""
    from looplm.data import sample_text

    ids = torch.tensor([tokenizer(sample_text(), add_special_tokens=False)["input_ids"][: n_tokens + 1]])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].double()
    return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))


@pytest.mark.real
def test_convert_info_eval(hf_dir, tmp_path):
    out = tmp_path / "relaxed"
    result = json.loads(
        run(
            "convert",
            str(hf_dir),
            "--loops",
            "2",
            "--lora-rank",
            "8",
            "--out",
            str(out),
            "--scored-tokens",
            "256",
            "--json",
        ).stdout
    )
    assert result["n_emb_after"] < result["n_emb_before"]
    import transformers

    from looplm.models import load_model

    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert result["ppl_tokens"] == 256
    assert result["ppl_before"] == pytest.approx(_reference_perplexity(original, tokenizer, 256), rel=1e-4)
    relaxed = load_model(out)[0].eval()
    assert result["ppl_after"] == pytest.approx(_reference_perplexity(relaxed, tokenizer, 256), rel=1e-4)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()

    info = json.loads(run("info", str(out), "--json").stdout)
    assert info["loops"] == 2 and info["layer_map"] == [0, 1, 1, 2] and info["n_emb"] == result["n_emb_after"]

    ppl = json.loads(run("eval", "ppl", str(out), "--json", "--scored-tokens", "200").stdout)
    assert ppl["tokens"] == 200 and len(ppl["per_loop"]) == 2
    assert ppl["perplexity"] == pytest.approx(_reference_perplexity(relaxed, tokenizer, 200), rel=1e-4)
    exit1 = json.loads(run("eval", "ppl", str(out), "--json", "--scored-tokens", "200", "--exit-loop", "1").stdout)
    assert exit1["perplexity"] == pytest.approx(ppl["per_loop"][0]["perplexity"], rel=1e-6)

    unrolled = tmp_path / "unrolled"
    run("unroll", str(out), "--out", str(unrolled))
    assert json.loads(run("info", str(unrolled), "--json").stdout)["loops"] == 1
    dense_ppl = json.loads(run("eval", "ppl", str(unrolled), "--json", "--scored-tokens", "200").stdout)
    assert dense_ppl["perplexity"] == pytest.approx(ppl["perplexity"], rel=1e-4)

    human = run(
        "convert", str(hf_dir), "--lora-rank", "0", "--out", str(tmp_path / "rec"), "--scored-tokens", "0"
    ).stdout
    assert "N-emb" in human and "wrote" in human


@pytest.mark.parametrize(
    "args,message",
    [
        (["--loops", "3", "--sharing", "cycle"], "does not divide"),
        (["--loops", "3"], "keep at least 3 in the core"),  # the default middle-cycle: 1 + 2 core layers + 1
        (["--lora-rank", "-1"], "negative"),
        (["--lora-ranks", "attn=4"], "unknown LoRA group"),
        (["--relax", "prefix", "--prefix-length", "-1"], "--prefix-length must be >= 0"),
    ],
)
@pytest.mark.real
def test_bad_convert_input(hf_dir, tmp_path, args, message):
    out = tmp_path / "never"
    proc = run("convert", str(hf_dir), "--out", str(out), "--scored-tokens", "0", *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.real
def test_rank_above_a_linear_is_capped_with_a_note(hf_dir, tmp_path):
    proc = run(
        "convert", str(hf_dir), "--out", str(tmp_path / "m"), "--scored-tokens", "0", "--lora-rank", "1000", "--json"
    )
    assert "LoRA rank 1000 for group kv is capped at" in proc.stderr
    assert json.loads(proc.stdout)["lora_ranks"]["kv"] < 1000


def test_unknown_model_name(tmp_path):
    proc = run("info", "no-such-model", check=False)
    assert proc.returncode == 2 and "smollm2-135m" in proc.stderr


@pytest.mark.real
def test_corrupt_checkpoint(hf_dir, tmp_path):
    out = tmp_path / "m"
    run("convert", str(hf_dir), "--lora-rank", "0", "--out", str(out), "--scored-tokens", "0")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = run("eval", "ppl", str(out), check=False)
    assert proc.returncode == 2 and "corrupt or truncated" in proc.stderr


@pytest.mark.real
def test_empty_text_file(hf_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    proc = run("eval", "ppl", str(hf_dir), "--text", str(empty), check=False)
    assert proc.returncode == 2 and "empty" in proc.stderr
