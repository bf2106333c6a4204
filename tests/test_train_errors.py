"""Bad input to `looplm train` / `looplm data build`: a one-line error naming the fix, exit code 2,
and the run directory untouched (or never created)."""

import hashlib
import random

import pytest
from test_train_fixtures import build_corpus, byte_tokenizer, make_models, tiny_vanilla

from looplm.commands import main
from looplm.data.corpus import PackedCorpus, build
from looplm.models import load_model, save_model
from looplm.train.loop import TrainConfig, estimate_memory, memory_available, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("err")
    models = make_models(tmp)
    corpus = build_corpus(tmp, models["student"], seq_len=32)
    # a teacher whose tokenizer has one more token
    models["other_tok"] = save_model(tiny_vanilla(), byte_tokenizer(extra="<x>"), tmp / "other_tok")
    return tmp, models, corpus


def snapshot(d):
    if not d.exists():
        return None
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(d.rglob("*"))
    }


def run_args(model, data, out, steps=1) -> list:
    """`looplm train`'s arguments for ``steps`` steps of ``model`` on ``data`` into ``out``."""
    return [model, "--data", data, "--out", out, "--max-steps", steps]


def train_cli(*argv) -> int:
    """`looplm train ARGV` in fp32 without a progress bar: its exit code."""
    return main(["train", *map(str, argv), "--precision", "fp32", "--no-progress"])


def fails(capsys, *argv, match):
    code = train_cli(*argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and err.startswith("looplm train: error:"), err
    assert match in err, err
    return err


def test_missing_and_empty_corpus(setup, capsys, tmp_path):
    _, models, _ = setup
    out = tmp_path / "run"
    fails(capsys, *run_args(models["student"], tmp_path / "nope", out), match="looplm data build --out")
    (tmp_path / "empty").mkdir()
    fails(capsys, *run_args(models["student"], tmp_path / "empty", out), match="no meta.json")
    assert not out.exists()


def test_tokenizer_mismatches(setup, capsys, tmp_path):
    _, models, corpus = setup
    out = tmp_path / "run"
    student = run_args(models["student"], corpus, out)
    fails(capsys, *student, "--teacher", models["other_tok"], match="different tokenizers")
    fails(capsys, *run_args(models["other_tok"], corpus, out), match="rebuild it with `looplm data build ")
    assert not out.exists()


def trains(model, corpus, out) -> None:
    """Two steps of `looplm train` of ``model`` on ``corpus`` into ``out``, which succeed."""
    assert train_cli(*run_args(model, corpus, out, steps=2)) == 0


def test_resume_from_another_models_run_leaves_it_untouched(setup, capsys):
    tmp, models, corpus = setup
    out = tmp / "run-student"
    trains(models["student"], corpus, out)
    capsys.readouterr()
    before = snapshot(out)
    fails(capsys, *run_args(models["recursive"], corpus, out, steps=2), "--resume", match="another model")
    student = run_args(models["student"], corpus, out, steps=2)
    fails(capsys, *student, match="add --resume")
    fails(capsys, *student, "--resume", "--lr", "1e-3", match="different settings (lr")
    # a checkpoint dir swapped in from another model's run
    other = tmp / "run-recursive"
    trains(models["recursive"], corpus, other)
    capsys.readouterr()
    import shutil

    hybrid = tmp / "hybrid"
    shutil.copytree(out, hybrid)
    shutil.rmtree(hybrid / "checkpoints" / "step-0000002")
    shutil.copytree(other / "checkpoints" / "step-0000002", hybrid / "checkpoints" / "step-0000002")
    h_before = snapshot(hybrid)
    fails(capsys, "--data", corpus, "--out", hybrid, "--max-steps", 2, "--resume", match="belongs to another model")
    assert snapshot(out) == before and snapshot(hybrid) == h_before


def test_batch_too_large(setup, capsys, tmp_path):
    _, models, corpus = setup
    n, out = len(PackedCorpus(corpus)), tmp_path / "r"
    fails(capsys, *run_args(models["student"], corpus, out), "--batch-size", n + 1, match="lower --batch-size")
    fails(capsys, *run_args(models["student"], corpus, out), "--train", "lora,embedx", match="unknown --train")
    fails(capsys, *run_args(models["recursive"], corpus, out), "--train", "lora", match="has no LoRA")
    assert not out.exists()


def test_batch_larger_than_memory(setup, capsys, tmp_path):
    """A corpus big enough for a batch that cannot fit: refused before anything is written."""
    _, models, _ = setup
    model, _ = load_model(models["student"])
    seq = 1024
    per_seq = estimate_memory(model.config, 0, None, 0, 1, seq, 1, False)
    # 1.5x what is free now: free memory moves while the suite runs (freed caches of earlier tests)
    batch = int(1.5 * memory_available(model.device)) // per_seq + 1
    rng = random.Random(0)
    words = ["loop", "depth", "shared", "layer", "relaxed", "rank", "token", "exit", "batch", "teacher"]
    text_dir = tmp_path / "big"
    text_dir.mkdir()
    chars = int(batch * seq * 1.1) + 10 * seq
    (text_dir / "words.txt").write_text(" ".join(rng.choice(words) for _ in range(chars // 6)))
    build(
        tmp_path / "corpus",
        model=str(models["student"]),
        sources=str(text_dir),
        seq_len=seq,
        heldout=0.0,
        log=lambda *a: None,
        progress=False,
    )
    assert len(PackedCorpus(tmp_path / "corpus")) >= batch
    err = fails(
        capsys,
        *run_args(models["student"], tmp_path / "corpus", tmp_path / "r"),
        "--batch-size",
        batch,
        match="GiB is free; lower --batch-size",
    )
    assert "--grad-checkpointing" in err and not (tmp_path / "r").exists()


def test_config_errors(setup):
    tmp, models, corpus = setup

    def config(**settings) -> TrainConfig:
        return TrainConfig(model=str(models["student"]), data=str(corpus), out=str(tmp / "x"), **settings)

    with pytest.raises(ValueError, match="give one budget: --max-steps N, --train-tokens N or --budget-minutes M"):
        train(config())
    with pytest.raises(ValueError, match="give one budget"):
        train(config(max_steps=1, budget_minutes=1.0))
    with pytest.raises(ValueError, match="--budget-minutes 0.0 must be positive"):
        train(config(budget_minutes=0.0))
    with pytest.raises(ValueError, match="add --early-exit"):
        train(config(max_steps=1, self_distill=True))
    with pytest.raises(ValueError, match="use one of fkl"):
        train(config(max_steps=1, kd="kl"))
    assert not (tmp / "x").exists()
