"""The parts `looplm train` and `looplm heal` share (train/run_dir.py, budget.py, optim.cosine): a checkpoint is
complete before `latest` names it and only the newest are kept; a resumed run drops the records after its
checkpoint; a resume is checked against the run's settings and their former defaults; a budget becomes step counts
one way; a checkpoint is a model directory with its training state, written and read one way."""

import json
import math
import time
from pathlib import Path

import pytest
import torch

from looplm.errors import UsageError
from looplm.train import step_loop
from looplm.train.budget import check_budget, steps_to_fill
from looplm.train.heal import HealConfig
from looplm.train.loop import TrainConfig
from looplm.train.optim import cosine
from looplm.train.run_dir import RunDir, changed_settings
from looplm.train.step_loop import Every, Position, StepLoop


def _checkpoint(run: RunDir, name: str, keep: int) -> None:
    time.sleep(0.05)  # apart on a file system's coarse clock
    tmp = run.staging(name)
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text(json.dumps({"name": name}))
    run.commit(tmp, name, keep)


def test_checkpoints_are_committed_whole_and_the_newest_kept(tmp_path):
    run = RunDir(tmp_path / "run")
    run.open()
    assert run.latest() is None
    for step in (1, 2, 3):
        _checkpoint(run, f"step-{step:07d}", keep=2)
    assert run.latest() == "step-0000003" and json.loads((run.latest_dir() / "state.json").read_text())
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-0000002", "step-0000003"]
    # names that do not sort in the order written (heal's stage-visit-step) are kept by time
    for name in ("local-002-000000", "e2e-002-000010", "exit-002-000003"):
        _checkpoint(run, name, keep=2)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["e2e-002-000010", "exit-002-000003"]
    # a kill while writing leaves a temporary directory, which the next run removes; `latest` still names a whole one
    (run.checkpoints / ".step-0000009.tmp").mkdir()
    run.open()
    assert not (run.checkpoints / ".step-0000009.tmp").exists() and run.latest() == "exit-002-000003"
    _checkpoint(run, "all-kept", keep=0)
    assert len(list(run.checkpoints.iterdir())) == 3


def test_a_checkpoint_is_a_model_directory_with_the_training_state_and_former_layouts_still_read(tmp_path):
    from conftest import tiny_model

    from looplm.models.checkpoint import load_checkpoint
    from looplm.train.checkpoints import Checkpointer, restore
    from looplm.train.teacher_cache import OneProcess

    class Tok:  # the tiny model has no tokenizer: a stand-in that writes one file
        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer.json").write_text("{}")

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    run = RunDir(tmp_path / "run")
    run.open()
    saver = Checkpointer(run, OneProcess(), sharded=False, keep=2)
    saver.save("step-0000001", model, Tok(), {"step": 1}, {"optimizer": opt.state_dict()})
    ck = run.latest_dir()
    assert json.loads((ck / "state.json").read_text()) == {"step": 1} and (ck / "tokenizer.json").exists()
    for (n, p), q in zip(model.state_dict().items(), load_checkpoint(ck).state_dict().values()):
        assert torch.equal(p, q), n
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    restore(again, saver.training()["optimizer"])
    assert again.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    # written before training.pt: healing's optimizer.pt and average.pt, `looplm train`'s Accelerate state
    (ck / "training.pt").unlink()
    torch.save(opt.state_dict(), ck / "optimizer.pt")
    torch.save({"decay": 0.9}, ck / "average.pt")
    assert set(saver.training()) == {"optimizer", "average"}
    for name in ("optimizer.pt", "average.pt"):
        (ck / name).unlink()
    (ck / "accelerate").mkdir()
    torch.save(opt.state_dict(), ck / "accelerate" / "optimizer.bin")
    torch.save({"last_epoch": 1}, ck / "accelerate" / "custom_checkpoint_0.pkl")
    assert saver.training()["scheduler"] == {"last_epoch": 1} and "optimizer" in saver.training()


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    for step in range(1, 6):
        run.append({"step": step, "loss": 1.0 / step})
    with open(run.metrics, "a") as f:
        f.write('{"step": 6, "lo')  # cut by a kill
    assert [r["step"] for r in run.records()] == [1, 2, 3, 4, 5]
    lines = run.metrics.read_text().splitlines()[:3]
    run.truncate(lambda r: r["step"] <= 3)
    assert run.metrics.read_text().splitlines() == lines  # the kept records as they were written


def test_a_resume_reads_former_defaults():
    now = HealConfig(train_tokens=100, hidden_loss="log1p")
    fixed, former = HealConfig.FIXED, HealConfig.FORMER_DEFAULTS
    saved = {k: getattr(now, k) for k in fixed if k != "hidden_loss"}
    # a run from before hidden_loss was recorded ran with "relative"
    assert changed_settings(saved, now, fixed, former) == ["hidden_loss: 'relative' -> 'log1p'"]
    assert changed_settings({**saved, "hidden_loss": "log1p"}, now, fixed, former) == []
    assert changed_settings({**saved, "hidden_loss": "log1p", "train_tokens": 50}, now, fixed, former) == [
        "train_tokens: 50 -> 100"
    ]
    # a setting the run did not record and whose default did not change had the field's default
    del saved["base_weights"]
    assert changed_settings({**saved, "hidden_loss": "log1p"}, now, fixed, former) == []
    train = TrainConfig(data_rows="new")
    assert changed_settings({"data_rows": "all"}, train, TrainConfig.FIXED, {})[-1] == "data_rows: 'all' -> 'new'"


def test_a_budget_is_one_of_time_or_tokens_and_fills_what_is_left():
    with pytest.raises(UsageError, match="give one budget: --budget-minutes N or --train-tokens N"):
        check_budget({"--budget-minutes N": None, "--train-tokens N": None})
    with pytest.raises(UsageError, match="give one budget: --a N, --b N or --c M"):
        check_budget({"--a N": 1, "--b N": 2, "--c M": None})
    with pytest.raises(UsageError, match="--train-tokens -5 must be positive"):
        check_budget({"--budget-minutes N": None, "--train-tokens N": -5})
    check_budget({"--budget-minutes N": 0.5, "--train-tokens N": None})
    assert steps_to_fill(10, 100.0, 3.0) == 43  # 33 more steps of 3 s fit 100 s
    assert steps_to_fill(10, -5.0, 3.0) == 10 and steps_to_fill(10, -5.0, 3.0, at_least=1) == 11


def test_an_evaluation_by_time_is_skipped_when_the_loop_ends_within_half_a_period(monkeypatch):
    every = Every(seconds=300)
    assert not every.due(7, 299.0) and every.due(7, 300.0) and every.due(7, 300.0, seconds_left=150.0)
    assert not every.due(7, 300.0, seconds_left=149.0)  # the recipe evaluates the loop's end
    assert Every(steps=7).due(7, 0.0, seconds_left=0.0)  # a cadence by steps is kept as asked
    # on the loop: 20 steps of 10 s, an evaluation due every 60 s: at 60 and 120, not at 180 (20 s before the end)
    clock = [0.0]
    monkeypatch.setattr(step_loop.time, "perf_counter", lambda: clock[0])

    def step(s, total):
        clock[0] += 10.0
        return {"loss": 0.0}

    evaluated = []
    StepLoop(
        *(step, 20, Position(), lambda: clock[0], "test"),
        show=False,
        evaluate=lambda: evaluated.append(clock[0]),
        evaluate_every=Every(seconds=60),
    ).run()
    assert evaluated == [60.0, 120.0]


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor():
    assert [cosine(s, 100, 4) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert cosine(4, 100, 4) == 1.0 and cosine(52, 100, 4) == pytest.approx(0.55)
    assert cosine(100, 100, 4, floor=0.1) == pytest.approx(0.1) and cosine(500, 100, 4, floor=0.0) == 0.0
    assert cosine(52, 100, 4, floor=0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
