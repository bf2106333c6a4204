"""A healing run in progress: where it is (``Progress``), its clock, and what it writes into its run directory
(run_dir.py): metrics records, checkpoints, held-out evaluations.

The run clock counts the budget: wall time since the run started (a resumed run goes on from its checkpoint's),
evaluations not counted. Checkpoints are named stage-visit-step; besides them the local stage's end is kept as
OUT/local-end, from which later stages can be started again with other settings.

On several processes every one runs the run, on its share of each step's rows, and the main process alone writes
the run directory: settings, records, checkpoints (under FSDP all gather the sharded weights for them). What a
process decides by its own clock (an evaluation, a checkpoint, a new step count) is the main process's decision
(``agreed``), so that all take the same steps."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from ...data.ood import geometric_ratio
from ...errors import UsageError
from ...models.exit_adapter import add_exit_adapters
from ..checkpoints import Checkpointer, restore
from ..distributed import mean_values
from ..evaluate import exit_sums, heldout_rows, perplexity, score_rows
from ..optim import WeightAverage
from ..run_dir import RunDir
from ..step_loop import Every, Position, RunClock, agreed
from ..teacher_cache import OneProcess
from .config import HealConfig
from .inputs import HealInputs
from .steps import eager

CHECKPOINTS_KEPT = 2


@dataclass
class Progress(Position):
    """Where a run is (``step``: steps done in the stage, end to end or exit; ``tokens``: trained on after the local
    stage, its end-to-end steps then the exit adapters'; ``time``: the run clock); a checkpoint's state.json."""

    stage: str = "cache"  # cache, local, e2e, exit, done
    visit: int = 0  # local visits done
    local_tokens: int = 0  # tokens of the local stage's steps

    @classmethod
    def read(cls, path: Path) -> Progress:
        saved = json.loads(path.read_text())
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})


def logged_by(record: dict, seconds: float) -> bool:
    """Whether a metrics record was written by run time ``seconds`` (a checkpoint's): records hold their time
    rounded to 10 ms, so it is compared rounded too, or the records written at the checkpoint would be dropped."""
    return record.get("time", 0.0) <= round(seconds, 2) + 1e-6


class HealRun:
    def __init__(
        self, cfg: HealConfig, inputs: HealInputs, exit_spec: dict | None, settings: dict | None, log, processes=None
    ):
        self.processes = processes if processes is not None else OneProcess()  # the run's Accelerator
        self.main = self.processes.is_main_process
        self.cfg, self.inputs, self.exit_spec = cfg, inputs, exit_spec
        self.log = log if self.main else lambda *a: None
        self.run_dir = RunDir(cfg.out)
        self.checkpoints = Checkpointer(self.run_dir, self.processes, inputs.sharded, keep=CHECKPOINTS_KEPT)
        self.settings = settings  # run.json: None until the run writes it
        self.progress = Progress()
        self.cache = None  # the teacher cache, once open
        self.clock = RunClock()  # evaluations paused: the budget does not count them
        self._last_eval = 0.0

    @property
    def plan(self) -> dict:
        return self.settings["plan"]

    def start_clock(self) -> None:
        """The run clock goes on from the progress's time."""
        self.clock.start(self.progress.time)

    def write_settings(self) -> None:
        if self.main:
            self.run_dir.write_settings(self.settings)

    # ----- what the processes share
    def agreed(self, value):
        """The main process's ``value`` (a picklable object), on every process."""
        return agreed(self.processes, value)

    def mean(self, values: dict) -> dict:
        """Each of ``values`` (floats: this process's losses on its share of a step) averaged over the processes."""
        return mean_values(self.processes, values)

    # ----- records
    def append(self, record: dict) -> None:
        if self.main:
            self.run_dir.append(record)

    def evals(self, tag: str) -> list[dict]:
        records = self.run_dir.records() if self.main else None
        return [r for r in self.agreed(records) if r.get("eval") and r.get("tag") == tag]

    # ----- evaluation: held-out perplexity at every loop exit
    @torch.no_grad()
    @eager()
    def evaluate(self, model) -> dict:
        with self.clock.paused():
            result = self._evaluate(model)
        self._last_eval = time.perf_counter()
        return result

    def _evaluate(self, model) -> dict:
        c, inputs = self.cfg, self.inputs
        rows = heldout_rows(inputs.corpus, c.eval_rows, c.seq_len)
        if not rows:
            raise UsageError(f"the corpus {c.data} has no held-out rows to evaluate on")
        model.eval()
        nll, agree, count = self.score(model, rows)
        ood = {}
        for name, windows in inputs.ood.items():  # the final exit on text the run never heals on
            domain_nll, _, domain_count = self.score(model, windows, final_only=True)
            ood[name] = perplexity(float(domain_nll[-1]) / domain_count)
        ppl = [perplexity(float(x) / count) for x in nll]
        # top-1 agreement of each loop's exit with the final one (teacher-forced): what an oracle exit rule gets
        return {
            "ppl": ppl[-1],
            "ppl_per_loop": ppl,
            "agree_per_loop": [round(float(a) / count, 4) for a in agree],
            "eval_tokens": count,
            **({"ood": ood} if ood else {}),
        }

    def score(self, model, rows, final_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every loop exit's summed NLL and agreement with the final exit over ``rows``, and the scored tokens;
        shared out among the processes (``score_rows``)."""
        nll, agree, count = score_rows(exit_sums(model, final_only), rows, self.inputs.device, self.processes)
        return nll, agree, int(count)

    def eval_due(self, seconds_left: float) -> bool:
        """Whether a held-out evaluation is due amid the local stage, which ends in ``seconds_left`` (on the step
        loop's cadence, ``Every``)."""
        every = Every(seconds=self.cfg.eval_every_seconds)
        return self.agreed(every.due(0, time.perf_counter() - self._last_eval, seconds_left))

    def log_eval(self, tag: str) -> dict:
        """Evaluate the student, append the record and say it."""
        ev = self.evaluate(self.inputs.student)
        teacher = self.settings["teacher_eval"]
        if "ood" in ev and "ood" in teacher:
            ev["ood_ratio"] = round(geometric_ratio(ev["ood"], teacher["ood"]), 4)
        p = self.progress
        self.append(
            {
                "eval": True,
                "tag": tag,
                **ev,
                "time": round(p.time, 2),
                "tokens": p.tokens,
                "local_tokens": p.local_tokens,
            }
        )
        self.log(
            f"held-out perplexity ({tag}, {p.time / 60:.1f} min): "
            + ", ".join(f"loop {i + 1} {x:,.2f}" for i, x in enumerate(ev["ppl_per_loop"]))
            + f" (original {teacher['ppl']:.2f})"
            + (f"; out of domain {ev['ood_ratio']:.3f}x the original" if "ood_ratio" in ev else "")
        )
        return ev

    # ----- checkpoints (train/checkpoints.py)
    def save(self, opt=None, average: WeightAverage | None = None) -> None:
        """A checkpoint: the student, the progress, and the stage's optimizer and weight average."""
        p = self.progress
        training = {"optimizer": opt.state_dict()} if opt is not None else {}
        if average is not None:
            training["average"] = average.state_dict()
        name = f"{p.stage}-{p.visit:03d}-{p.step:06d}"
        self.checkpoints.save(name, self.inputs.student, self.inputs.tok, asdict(p), training)

    def load(self, ck: Path) -> None:
        """The student's weights and the progress of checkpoint ``ck``: read into the whole student, before its
        layers are placed on the device (sharded under FSDP)."""
        from ...models.checkpoint import load_checkpoint

        if not (ck / "state.json").exists():
            raise UsageError(f"checkpoint {ck} is incomplete; delete {self.run_dir.out / 'latest'} to start over")
        loaded = load_checkpoint(ck)
        student = self.inputs.student
        if loaded.config.exit_adapter and student.exit_adapter is None:  # saved in the exit stage
            add_exit_adapters(student, loaded.config.exit_adapter["kind"], loaded.config.exit_adapter.get("rank"))
        student.load_state_dict(loaded.state_dict())
        self.progress = Progress.read(ck / "state.json")

    def load_optimizer(self, opt, average: WeightAverage | None) -> None:
        """The optimizer's (and weight average's) state of the latest checkpoint, saved by a stage in progress."""
        saved = self.checkpoints.training()
        restore(opt, saved["optimizer"])
        if average is not None:
            restore(average, saved["average"])

    def keep_local_end(self) -> None:
        """A copy of the checkpoint at the end of the local stage, kept as OUT/local-end (the rotation deletes
        the checkpoint itself), from which later stages can be started again with other settings."""
        if not self.main:
            return
        out = self.run_dir.out
        tmp = out / ".local-end.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(self.run_dir.latest_dir(), tmp)
        shutil.rmtree(out / "local-end", ignore_errors=True)
        tmp.rename(out / "local-end")
