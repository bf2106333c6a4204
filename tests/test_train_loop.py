"""The training loop on a tiny converted model and a small real-text corpus: exact resume after
kill -9, 2-process gloo == 1 process, gradient accumulation, freezing, checkpoints, plot."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from test_train_fixtures import ROOT, SRC, build_corpus, free_port, make_models, metrics, run_cli

from looplm.commands import main
from looplm.models import load_model
from looplm.models.checkpoint import load_checkpoint
from looplm.train.loop import TrainConfig, batch_indices, lr_lambda_factory, train
from looplm.util import cpu_model

FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


def train_losses(run):
    return {r["step"]: r["loss"] for r in metrics(run) if not r.get("eval")}


def test_kill9_then_resume_repeats_the_uninterrupted_losses(setup):
    tmp, models, corpus = setup
    args = [
        "train",
        models["student"],
        "--data",
        corpus,
        "--teacher",
        models["teacher"],
        "--kd",
        "fkl",
        "--early-exit",
        "aggressive",
        "--self-distill",
        "--max-steps",
        36,
        "--batch-size",
        4,
        "--save-every-steps",
        4,
        "--eval-every-steps",
        12,
        "--precision",
        "fp32",
        "--no-progress",
    ]
    full, cut = tmp / "full", tmp / "cut"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    # the uninterrupted run, and beside it the same run killed with SIGKILL mid-run
    uninterrupted = subprocess.Popen(
        [sys.executable, "-m", "looplm", *map(str, args), "--out", str(full)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "looplm", *map(str, args), "--out", str(cut)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 200
    while time.time() < deadline:
        if (cut / "metrics.jsonl").exists() and len(train_losses(cut)) >= 10:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(train_losses(cut))
    assert killed_at < 36 and not (cut / "final").exists()
    assert uninterrupted.wait(timeout=240) == 0, uninterrupted.stderr.read()
    r = run_cli(*args, "--out", cut, "--resume")
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout
    a, b = train_losses(full), train_losses(cut)
    assert sorted(a) == sorted(b) == list(range(1, 37))
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-6
    ev_a = [r for r in metrics(full) if r.get("eval")]
    ev_b = [r for r in metrics(cut) if r.get("eval")]
    assert [e["step"] for e in ev_a] == [e["step"] for e in ev_b] == [0, 12, 24, 36]
    assert max(abs(x["eval_loss_1"] - y["eval_loss_1"]) for x, y in zip(ev_a, ev_b)) <= 1e-6
    # the final weights agree too
    wa, _ = load_model(full / "final")
    wb, _ = load_model(cut / "final")
    for (n, p), q in zip(wa.state_dict().items(), wb.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-6), n
    # only `keep` complete checkpoints, no temp dirs
    ckpts = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert ckpts == ["step-0000032", "step-0000036"] and (cut / "latest").read_text().strip() == "step-0000036"


@pytest.mark.parametrize("launch", ["data-parallel", "fsdp"])
def test_two_gloo_processes_equal_one_process(setup, launch):
    """Two processes, whole (the gradients averaged after the backward) or with the layers sharded (FSDP2, the
    config's launch), take one process's steps: the same losses, step by step."""
    tmp, models, corpus = setup
    args = [
        models["student"],
        "--data",
        corpus,
        "--teacher",
        models["teacher"],
        "--early-exit",
        "weighted",
        "--max-steps",
        5,
        "--eval-every-steps",
        5,
        "--precision",
        "fp32",
        "--no-progress",
    ]
    one = tmp / "one"
    if not (one / "final").exists():
        r1 = run_cli("train", *args, "--out", one, "--batch-size", 2, "--grad-accum", 2)
        assert r1.returncode == 0, r1.stderr
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    if launch == "fsdp":  # with no GPU, accelerate launch starts gloo processes on the CPU
        starter = ["accelerate.commands.launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "2"]
        starter += ["--main_process_port", str(free_port())]
    else:
        starter = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    two = tmp / f"two-{launch}"
    command = [sys.executable, "-m", *starter, "-m", "looplm", "train", *map(str, args), "--out", str(two)]
    r2 = subprocess.run(
        command + ["--batch-size", "1", "--grad-accum", "2"], env=env, capture_output=True, text=True, timeout=240
    )
    assert r2.returncode == 0, r2.stderr
    run = json.loads((two / "run.json").read_text())
    assert run["world"] == 2 and run["global_batch"] == 4
    a, b = metrics(one), metrics(two)
    assert len(a) == len(b) == 7
    for x, y in zip(a, b):
        for k in ("loss", "ce_1", "ce_2", "kd", "eval_loss_1", "eval_loss_2"):
            if k in x:
                assert abs(x[k] - y[k]) <= 1e-5, (x["step"], k, x[k], y[k])
    # the final model holds the whole weights, however they were held in training
    final_one, final_two = load_checkpoint(one / "final"), load_checkpoint(two / "final")
    for (n, p), q in zip(final_one.state_dict().items(), final_two.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-5), n


def _cfg(setup, out, **kw):
    tmp, models, corpus = setup
    base = dict(
        model=str(models["student"]),
        data=str(corpus),
        out=str(tmp / out),
        max_steps=3,
        precision="fp32",
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def test_grad_accumulation_equals_the_larger_batch(setup):
    quiet = lambda *a: None  # noqa: E731
    train(_cfg(setup, "acc1", batch_size=4, grad_accum=1), quiet)
    train(_cfg(setup, "acc4", batch_size=1, grad_accum=4), quiet)
    tmp = setup[0]
    a, b = train_losses(tmp / "acc1"), train_losses(tmp / "acc4")
    assert max(abs(a[s] - b[s]) for s in a) <= 1e-5
    ma, _ = load_model(tmp / "acc1" / "final")
    mb, _ = load_model(tmp / "acc4" / "final")
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert torch.allclose(p, q, atol=1e-5)


def test_train_lora_only_changes_lora(setup):
    tmp, models, _ = setup
    train(_cfg(setup, "lora", train="lora", lr=1e-2), lambda *a: None)
    before, _ = load_model(models["student"])
    after, _ = load_model(tmp / "lora" / "final")
    changed = {n for (n, p), q in zip(before.named_parameters(), after.parameters()) if not torch.equal(p, q)}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_A" in n for n in changed)


def test_time_budget_becomes_a_step_count_that_resume_keeps(setup, monkeypatch):
    """--budget-minutes: the step count is fixed from the first timed steps by the step loop (written to run.json
    with the steps it was fixed at), and the cosine schedule then runs over it; a resumed run keeps the count
    instead of timing again. The loop's clock moves 1/16 s a step, so the count does not hang on the machine's
    speed (0.75 s: 12 steps, fixed before step 3 from steps 1 and 2; the first warms up)."""
    from looplm.train import step_loop
    from looplm.train.loop import Trainer

    now = [0.0]
    monkeypatch.setattr(step_loop, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    one_step = Trainer._step

    def timed_step(self, *args):
        now[0] += 0.0625
        return one_step(self, *args)

    monkeypatch.setattr(Trainer, "_step", timed_step)
    tmp = setup[0]
    logged = []
    train(_cfg(setup, "budget", max_steps=None, budget_minutes=0.0125, lr=1e-3), logged.append)
    run = json.loads((tmp / "budget" / "run.json").read_text())
    total = run["max_steps"]
    assert (total, run["replanned_at"]) == (12, [3])
    assert [m for m in logged if m.startswith("budget")] == ["budget: 0.06 s per step, 12 steps fill 0.0125 minutes"]
    recs = [r for r in metrics(tmp / "budget") if not r.get("eval")]
    assert [r["step"] for r in recs] == list(range(1, total + 1))
    f = lr_lambda_factory(max(1, round(0.05 * total)), total, 0.1)
    for r in recs[3:]:  # steps after the fix follow the count's schedule
        assert r["lr"] == pytest.approx(1e-3 * f(r["step"] - 1))
    assert (tmp / "budget" / "final" / "config.json").exists()
    train(_cfg(setup, "budget", max_steps=None, budget_minutes=0.0125, lr=1e-3, resume=True), lambda *a: None)
    run = json.loads((tmp / "budget" / "run.json").read_text())
    assert run["max_steps"] == total and run["machines"] == [cpu_model()]  # the minutes' machine, named once
    assert len([r for r in metrics(tmp / "budget") if not r.get("eval")]) == total


def test_schedule_and_data_order():
    f = lr_lambda_factory(warmup=4, total=20, min_ratio=0.1)
    assert [round(f(s), 4) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1) and f(12) == pytest.approx(0.55)
    seen = sum((batch_indices(s, 3, 10, 0).tolist() for s in range(3)), [])
    assert len(set(seen)) == 9  # one epoch: no repeats
    assert batch_indices(3, 3, 10, 0).tolist() != batch_indices(0, 3, 10, 0).tolist()  # next epoch reshuffles
    assert batch_indices(5, 3, 10, 7).tolist() == batch_indices(5, 3, 10, 7).tolist()


def test_no_weight_decay_on_norms_and_biases():
    """LoopLinear biases are 2-D ([slots, out]); they must still land in the no-decay group."""
    from conftest import make_hf_model

    from looplm.convert import convert
    from looplm.models import from_hf_model
    from looplm.train.loop import param_groups

    model = convert(from_hf_model(make_hf_model("llama-untied")), loops=2, norms="per-depth", lora_ranks=4)
    decay, no_decay = (g["params"] for g in param_groups(model, 0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    assert not [names[id(p)] for p in decay if names[id(p)].endswith("bias") or "norm" in names[id(p)]]
    assert any(names[id(p)].endswith("q_proj.bias") for p in no_decay)
    assert any("lora_A" in names[id(p)] for p in decay) and any(names[id(p)].endswith("q_proj.weight") for p in decay)


def test_early_exit_post_training_reads_new_rows_by_default(setup, monkeypatch):
    """The paper post-trains on new tokens: with the same seed it must not re-read the uptraining's rows."""
    import looplm.train.loop as loop

    tmp = setup[0]
    seen, real = [], loop.micro_batch
    monkeypatch.setattr(loop, "micro_batch", lambda *a: seen.append(real(*a).tolist()) or real(*a))

    def rows_of(run, **kw):
        seen.clear()
        train(_cfg(setup, run, batch_size=4, **kw), lambda *a: None)
        return {r for batch in seen for r in batch}

    up = rows_of("up")
    post = rows_of("post", model=str(tmp / "up" / "final"), early_exit="aggressive")
    assert up and post and not up & post
    again = rows_of("again", model=str(tmp / "up" / "final"))  # plain uptraining keeps reading all rows
    assert again == up
    shared = rows_of("post-all", model=str(tmp / "up" / "final"), early_exit="aggressive", data_rows="all")
    assert shared == up
    model, _ = load_model(tmp / "post" / "final")
    assert [r["new_rows"] for r in model.config.conversion["training"]] == [False, True]
    assert [r["steps"] for r in model.config.conversion["training"]] == [3, 3]


def test_new_rows_run_out_with_a_clear_error(setup):
    """A model whose earlier training read every row (one step of a corpus-sized batch) has no new ones."""
    from looplm.data.corpus import PackedCorpus
    from looplm.errors import UsageError
    from looplm.models import save_model

    tmp, models, corpus = setup
    meta = PackedCorpus(corpus).meta["splits"]["train"]
    model, tok = load_model(models["student"])
    model.config.conversion["training"] = [
        {"corpus": meta["sha256"], "seed": 5, "global_batch": meta["seqs"], "steps": 1, "new_rows": False}
    ]
    save_model(model, tok, tmp / "read-all")
    with pytest.raises(UsageError, match="--data-rows all"):
        train(_cfg(setup, "read-all-post", model=str(tmp / "read-all"), early_exit="aggressive"), lambda *a: None)


def test_plot_writes_pngs(setup):
    tmp, models, corpus = setup
    train(_cfg(setup, "plotrun", eval_every_steps=1, early_exit="aggressive"), lambda *a: None)
    assert main(["plot", str(tmp / "plotrun")]) == 0
    for name in ("loss.png", "perplexity.png"):
        data = (tmp / "plotrun" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_scratch_baseline_is_a_fresh_shallower_vanilla_model(tmp_path):
    from test_train_fixtures import byte_tokenizer, tiny_vanilla

    from looplm.models import save_model

    src = save_model(tiny_vanilla(seed=1, layers=4), byte_tokenizer(), tmp_path / "src")
    assert main(["baseline", str(src), "--init", "scratch", "--layers", "2", "--out", str(tmp_path / "s")]) == 0
    m, tok = load_model(tmp_path / "s")
    v, _ = load_model(src)
    assert m.config.num_hidden_layers == 2 and m.config.num_loops == 1 and tok is not None
    assert m.config.hidden_size == v.config.hidden_size and m.config.vocab_size == v.config.vocab_size
    assert not torch.equal(m.model.layers[0].mlp.up_proj.weight, v.model.layers[0].mlp.up_proj.weight)


def test_stepwise_baseline_is_the_selected_pretrained_layers_without_looping(tmp_path):
    """Appendix E's "pretrained Stepwise layers, no looping": K layers run once, N-emb as the recursive model's."""
    from test_train_fixtures import byte_tokenizer, tiny_vanilla

    from looplm.convert import convert, count_parameters
    from looplm.models import save_model

    src = save_model(tiny_vanilla(seed=1, layers=4), byte_tokenizer(), tmp_path / "src")
    assert main(["baseline", str(src), "--loops", "2", "--out", str(tmp_path / "w")]) == 0
    m, _ = load_model(tmp_path / "w")
    v, _ = load_model(src)
    assert m.config.num_hidden_layers == 2 and m.config.num_loops == 1
    assert m.config.conversion["layers"] == [0, 3]
    for j, i in enumerate([0, 3]):
        for (name, p), q in zip(m.model.layers[j].named_parameters(), v.model.layers[i].parameters()):
            assert torch.equal(p, q), name
    assert torch.equal(m.model.embed_tokens.weight, v.model.embed_tokens.weight)
    assert torch.equal(m.model.norm.weight, v.model.norm.weight)
    recursive = convert(v, loops=2, init="stepwise", lora_ranks=0)
    assert count_parameters(m)["n_emb"] == count_parameters(recursive)["n_emb"]
    assert main(["baseline", str(src), "--loops", "3", "--out", str(tmp_path / "x")]) == 2  # 3 does not divide 4
