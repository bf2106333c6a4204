"""scripts/paper_runs.sh's bookkeeping: every finished student's small results land in KEEP, a later run on a
machine whose out/ is empty continues from KEEP without retraining anyone, and KEEP, or a student already
trained in OUT, refuses students of another recipe. The looplm commands themselves are tested elsewhere; here
a stand-in `looplm` records each call and writes the files the real one writes, so that the script's own logic
is what runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Writes what each real subcommand writes (paths from its --out / --save-dir) and logs its arguments.
FAKE_LOOPLM = r"""#!/usr/bin/env python3
import json, sys
from pathlib import Path
args = sys.argv[1:]
with open(Path(__file__).with_name("calls.jsonl"), "a") as f:
    f.write(json.dumps(args) + "\n")
def opt(name):
    return args[args.index(name) + 1]
cmd = args[0] if args[0] not in ("data", "eval") else " ".join(args[:2])
if cmd == "data build":
    Path(opt("--out")).mkdir(parents=True, exist_ok=True); (Path(opt("--out")) / "meta.json").write_text("{}")
elif cmd == "convert":
    Path(opt("--out")).mkdir(parents=True, exist_ok=True); (Path(opt("--out")) / "config.json").write_text("{}")
elif cmd == "train":
    run = Path(opt("--out")); (run / "final").mkdir(parents=True, exist_ok=True)
    (run / "run.json").write_text(json.dumps({"config": {"max_tokens": int(opt("--max-tokens")),
                                                          "precision": opt("--precision")}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": int(opt("--max-tokens"))}) + "\n")
elif cmd in ("eval fewshot", "eval ppl"):
    ev = Path(opt("--save-dir")) / "eval"; ev.mkdir(parents=True, exist_ok=True)
    name = "fewshot.json" if cmd == "eval fewshot" else "ppl-heldout_sample.json"
    (ev / name).write_text(json.dumps({"model_spec": args[2]}))
elif cmd in ("plot", "report"):
    Path(opt("--out")).mkdir(parents=True, exist_ok=True); (Path(opt("--out")) / f"{cmd}.done").write_text("")
"""


def run_script(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    fake = tmp_path / "bin" / "looplm"
    if not fake.exists():
        fake.parent.mkdir()
        fake.write_text(FAKE_LOOPLM)
        fake.chmod(0o755)
    full = {**os.environ, "LOOPLM": str(fake), "OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"),
            "KEEP": str(tmp_path / "keep"), "STUDENTS": "rec-stepwise rel-svd64", "TOKENS": "2048", **env}
    return subprocess.run(["bash", str(ROOT / "scripts/paper_runs.sh")], env=full, capture_output=True, text=True)


def calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "bin" / "calls.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return [json.loads(line) for line in lines]


def test_finished_students_are_kept_and_a_new_machine_continues_from_them(tmp_path):
    first = run_script(tmp_path)
    assert first.returncode == 0, first.stderr
    made = calls(tmp_path)
    assert [c[0] for c in made].count("train") == 2
    keep = tmp_path / "keep"
    for name in ("original", "rec-stepwise", "rel-svd64"):
        assert (keep / name / "eval" / "fewshot.json").exists()
        assert (keep / name / "eval" / "ppl-heldout_sample.json").exists()
    assert json.loads((keep / "rec-stepwise" / "metrics.jsonl").read_text())["tokens"] == 2048
    assert not (keep / "original" / "metrics.jsonl").exists()  # the original was never trained
    assert (keep / "settings").read_text().strip() == "tokens=2048 precision=fp32 loops=2"
    assert (keep / "report.done").exists() and (keep / "plot.done").exists()
    assert not list(keep.glob(".*.tmp"))

    # A new machine: out/ is gone. Nobody is trained or evaluated again; the report is rebuilt from KEEP.
    subprocess.run(["rm", "-rf", str(tmp_path / "out")], check=True)
    again = run_script(tmp_path)
    assert again.returncode == 0, again.stderr
    assert [c[0] for c in calls(tmp_path) if c[0] != "data"] == ["plot", "report"]

    # One more student: only it is converted, trained and evaluated.
    more = run_script(tmp_path, STUDENTS="rec-stepwise rel-svd64 rec-random")
    assert more.returncode == 0, more.stderr
    trained = [c for c in calls(tmp_path) if c[0] == "train"]
    assert len(trained) == 1 and trained[0][trained[0].index("--out") + 1].endswith("runs/rec-random")


def test_keep_refuses_students_of_another_recipe(tmp_path):
    assert run_script(tmp_path).returncode == 0
    calls(tmp_path)
    other = run_script(tmp_path, TOKENS="4096")
    assert other.returncode == 2
    assert "tokens=2048 precision=fp32 loops=2" in other.stderr and "TOKENS" in other.stderr
    assert not calls(tmp_path)  # refused before converting or training anything


def test_a_student_trained_in_out_with_another_recipe_is_refused(tmp_path):
    """scripts/exit_model.sh gives paper_runs.sh a new KEEP inside OUT: the students already trained in OUT must
    then have the recipe asked for, or the new KEEP would record settings they were not trained with."""
    assert run_script(tmp_path, TOKENS="4096", PRECISION="bf16").returncode == 0
    calls(tmp_path)
    other = run_script(tmp_path, KEEP=str(tmp_path / "out" / "kept"))
    assert other.returncode == 2
    assert "runs/rec-stepwise was trained with 'tokens=4096 precision=bf16'" in other.stderr
    assert not calls(tmp_path) and not (tmp_path / "out" / "kept" / "settings").exists()
    same = run_script(tmp_path, KEEP=str(tmp_path / "out" / "kept"), TOKENS="4096", PRECISION="bf16")
    assert same.returncode == 0, same.stderr
    assert not [c for c in calls(tmp_path) if c[0] == "train"]  # trained already: evaluated into the new KEEP only
