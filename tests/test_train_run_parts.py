"""The parts `looplm train` and `looplm heal` share (train/run_dir.py, budget.py, optim.cosine): a checkpoint is
complete before `latest` names it and only the newest are kept; a resumed run drops the records after its
checkpoint; a resume is checked against the run's settings and their former defaults; a budget becomes step counts
one way."""

import json
import math
import time

import pytest

from looplm.errors import UsageError
from looplm.train.budget import check_budget, steps_to_fill
from looplm.train.heal import HealConfig
from looplm.train.loop import TrainConfig
from looplm.train.optim import cosine
from looplm.train.run_dir import RunDir, changed_settings


def _checkpoint(run: RunDir, name: str, keep: int, order) -> None:
    tmp = run.staging(name)
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text(json.dumps({"name": name}))
    run.commit(tmp, name, keep, order)


def test_checkpoints_are_committed_whole_and_the_newest_kept(tmp_path):
    run = RunDir(tmp_path / "run")
    run.open()
    assert run.latest() is None
    for step in (1, 2, 3):
        _checkpoint(run, f"step-{step:07d}", keep=2, order=lambda p: p.name)
    assert run.latest() == "step-0000003" and json.loads((run.latest_dir() / "state.json").read_text())
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-0000002", "step-0000003"]
    # names that do not sort in the order written (heal's stage-visit-step) are kept by time
    for name in ("local-002-000000", "e2e-002-000010", "exit-002-000003"):
        time.sleep(0.05)  # apart on a file system's coarse clock
        _checkpoint(run, name, keep=2, order=lambda p: p.stat().st_mtime)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["e2e-002-000010", "exit-002-000003"]
    # a kill while writing leaves a temporary directory, which the next run removes; `latest` still names a whole one
    (run.checkpoints / ".step-0000009.tmp").mkdir()
    run.open()
    assert not (run.checkpoints / ".step-0000009.tmp").exists() and run.latest() == "exit-002-000003"
    _checkpoint(run, "all-kept", keep=0, order=lambda p: p.name)
    assert len(list(run.checkpoints.iterdir())) == 3


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


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor():
    assert [cosine(s, 100, 4) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert cosine(4, 100, 4) == 1.0 and cosine(52, 100, 4) == pytest.approx(0.55)
    assert cosine(100, 100, 4, floor=0.1) == pytest.approx(0.1) and cosine(500, 100, 4, floor=0.0) == 0.0
    assert cosine(52, 100, 4, floor=0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
