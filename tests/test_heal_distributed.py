"""`looplm heal` on several processes (torchrun, gloo on the CPU): two processes heal as one does at the same global
batch, data parallel or with their layers sharded (FSDP2, `accelerate launch` with configs/accelerate/fsdp.yaml); a
run killed with SIGKILL, of one process, of two or of two sharded, resumes as the uninterrupted run, step by step; a
batch the processes cannot share is refused, and so is a weight average of sharded layers; on CUDA, a smoke run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_heal import heal_args
from test_train_fixtures import ROOT, SRC, build_corpus, free_port, make_models, metrics, ood_texts  # noqa: F401 (fixture)

# Two processes average two half-batch gradients where one process takes the mean over the whole batch: the same
# sums in another order, in float32, whose last-bit differences AdamW carries on. Measured on this config: held-out
# perplexity 1.2e-7 apart (relative), step losses 2.4e-5 (the KD term, a small number), weights 7e-6. The
# tolerances leave a margin of about 10 to 100; an error in the split (a process's rows, gradients or sums left
# out) moves the perplexity by 1e-3 or more.
PPL_TOLERANCE = 1e-5  # relative
LOSS_TOLERANCE = 2e-4  # relative
WEIGHT_TOLERANCE = 1e-4  # absolute
# Sharded (FSDP2), the gradients are averaged by a reduce-scatter instead: the same sums in another order again, under
# the same tolerances. Measured on this config: the same held-out perplexity to the last bit, step losses 2.8e-5
# apart, weights 8.9e-6.
FSDP_CONFIG = ROOT / "configs" / "accelerate" / "fsdp.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread, ood_texts):  # noqa: F811 (the fixture)
    tmp = tmp_path_factory.mktemp("heal-dist")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


def heal_command(setup, processes: int | str, out: Path, *extra) -> list[str]:
    """`looplm heal` of the tiny student on ``processes`` processes (torchrun for more than one; "fsdp": two,
    launched with the FSDP config): local, end-to-end and exit-adapter stages, on a token budget, in float32."""
    _, models, corpus = setup
    args = heal_args(models, corpus, out, "--ood-windows", 2, "--train-tokens", 64 * 60, "--precision", "fp32", *extra)
    if processes == "fsdp":  # with no GPU, accelerate launch starts gloo processes on the CPU
        launch = ["-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "2"]
        launch += ["--main_process_port", str(free_port())]
    elif processes > 1:
        launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(free_port())]
    else:
        launch = []
    return [sys.executable, *launch, "-m", "looplm", *map(str, args)]


ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def uninterrupted(setup):
    """The run on one process, on two and on two sharded, started together: {processes: run directory}; what each
    printed is kept beside it (DIR.log)."""
    tmp = setup[0]
    outs = {n: tmp / f"uninterrupted-{n}" for n in (1, 2, "fsdp")}
    procs = {
        n: subprocess.Popen(heal_command(setup, n, out), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for n, out in outs.items()
    }
    for n, proc in procs.items():
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err.decode()
        outs[n].with_name(f"{outs[n].name}.log").write_bytes(out)
    return outs


def by_step(out: Path) -> dict:
    """The run's records by what they record: a local visit, an end-to-end or exit step, an evaluation's tag."""
    keyed = {}
    for r in metrics(out):
        key = ("eval", r["tag"]) if r.get("eval") else (r["stage"], r.get("visit", r.get("step")))
        assert key not in keyed, f"{key} recorded twice in {out}"
        keyed[key] = r
    return keyed


def assert_same_steps(a: Path, b: Path, rel: float) -> None:
    ra, rb = by_step(a), by_step(b)
    assert sorted(ra, key=str) == sorted(rb, key=str)
    for key, x in ra.items():
        for name, value in x.items():
            if isinstance(value, float) and name != "time":
                assert rb[key][name] == pytest.approx(value, rel=rel, abs=1e-9), (key, name)


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], rtol=0, atol=atol), name


def test_two_gloo_processes_heal_as_one_process_does(uninterrupted):
    """torchrun --nproc_per_node 2 at the same global batch (each process half of every step's rows): the same
    teacher cache byte for byte (built by rows), the same steps, the held-out perplexity of one process."""
    one, two = uninterrupted[1], uninterrupted[2]
    cache = [json.loads((out / "cache" / "meta.json").read_text())["sha256"] for out in (one, two)]
    assert cache[0] == cache[1]
    s1, s2 = (json.loads((out / "heal.json").read_text()) for out in (one, two))
    assert s1["tokens"] == s2["tokens"] > 0 and s1["local_tokens"] == s2["local_tokens"] > 0
    assert s2["healed"]["eval_tokens"] == s1["healed"]["eval_tokens"] > 0
    assert s2["healed"]["ppl"] == pytest.approx(s1["healed"]["ppl"], rel=PPL_TOLERANCE)
    assert s2["healed"]["ood_ratio"] == pytest.approx(s1["healed"]["ood_ratio"], rel=PPL_TOLERANCE)
    assert_same_steps(one, two, LOSS_TOLERANCE)
    assert_same_weights(one, two, WEIGHT_TOLERANCE)
    # the main process alone wrote the run directory: one record per step, two checkpoints
    assert len([p for p in (two / "checkpoints").iterdir() if not p.name.startswith(".")]) == 2


def test_two_sharded_processes_heal_as_one_process_does(uninterrupted):
    """accelerate launch with the FSDP config, each process holding half of every layer: the same steps, the
    held-out perplexity of one process, and a final model of the full weights, as one process writes it."""
    one, sharded = uninterrupted[1], uninterrupted["fsdp"]
    assert "FSDP2: the layers sharded over 2 processes" in sharded.with_name(f"{sharded.name}.log").read_text()
    s1, s2 = (json.loads((out / "heal.json").read_text()) for out in (one, sharded))
    assert s1["tokens"] == s2["tokens"] > 0 and s1["local_tokens"] == s2["local_tokens"] > 0
    assert s2["healed"]["eval_tokens"] == s1["healed"]["eval_tokens"] > 0
    assert s2["healed"]["ppl"] == pytest.approx(s1["healed"]["ppl"], rel=PPL_TOLERANCE)
    assert s2["healed"]["ood_ratio"] == pytest.approx(s1["healed"]["ood_ratio"], rel=PPL_TOLERANCE)
    assert_same_steps(one, sharded, LOSS_TOLERANCE)
    assert_same_weights(one, sharded, WEIGHT_TOLERANCE)  # the final model: every weight, whole


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs (from /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [d for c in children for d in (c, *descendants(c))]


def kill_when(proc: subprocess.Popen, done) -> None:
    """SIGKILL to every process of the run once ``done()`` (polled), before it finishes."""
    deadline = time.time() + 300
    while time.time() < deadline and not done():
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    for pid in [*descendants(proc.pid), proc.pid]:  # torchrun starts each worker in a session of its own
        os.kill(pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("processes", [1, 2])
def test_a_killed_run_resumes_as_the_uninterrupted_run(setup, uninterrupted, processes):
    """SIGKILL to every process of the run at its first checkpoint (a local visit), then --resume: every local
    visit, end-to-end and exit step and every evaluation repeats the uninterrupted run's, and so do the weights."""
    out = setup[0] / f"killed-{processes}"
    command = heal_command(setup, processes, out)
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when(proc, lambda: (out / "latest").exists())
    assert not (out / "final").exists()
    assert (out / "latest").read_text().startswith("local-")
    r = run(command + ["--resume"])
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout
    assert_same_steps(uninterrupted[processes], out, rel=1e-6)
    assert_same_weights(uninterrupted[processes], out, atol=1e-6)


def test_a_sharded_run_killed_mid_stage_resumes_as_the_uninterrupted_run(setup, uninterrupted):
    """The sharded run killed within its end-to-end stage (a checkpoint every step: the AdamW moments are gathered
    whole into it, and sharded again on --resume), then resumed: every step, evaluation and weight as the
    uninterrupted sharded run's."""
    out = setup[0] / "killed-fsdp"
    # no evaluation when the resumed run starts (its first is due at once): the uninterrupted run has none there
    command = heal_command(setup, "fsdp", out, "--save-every-seconds", 0, "--eval-every-seconds", 1e9)
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def mid_stage() -> bool:
        latest = (out / "latest").read_text().strip() if (out / "latest").exists() else ""
        return latest.startswith("e2e-") and not latest.endswith("-000000")

    kill_when(proc, mid_stage)
    assert not (out / "final").exists()
    r = run(command + ["--resume"])
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout and "at stage e2e" in r.stdout
    assert_same_steps(uninterrupted["fsdp"], out, rel=1e-6)
    assert_same_weights(uninterrupted["fsdp"], out, atol=1e-6)


def test_a_weight_average_is_refused_under_fsdp(setup, monkeypatch):
    """Refused where the run reads its inputs, before it writes anything: here for one of two processes of a launch
    with the FSDP config, as its environment says."""
    from types import SimpleNamespace

    from looplm.errors import UsageError
    from looplm.train.heal import HealConfig
    from looplm.train.heal.inputs import load_inputs

    _, models, corpus = setup
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    cfg = HealConfig(
        model=str(models["student"]),
        teacher=str(models["teacher"]),
        data=str(corpus),
        out=str(setup[0] / "averaged"),
        seq_len=32,
        cache_rows=16,
        local_batch=2,
        e2e_average=0.9,
    )
    two = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=2)
    with pytest.raises(UsageError, match=r"--e2e-average 0\.9 .* sharded \(FSDP\)"):
        load_inputs(cfg, two)


def test_a_batch_the_processes_cannot_share_is_refused(setup, tmp_path):
    r = run(heal_command(setup, 2, tmp_path / "odd", "--e2e-batch", 3))
    assert r.returncode != 0
    assert "--e2e-batch 3" in r.stderr and "multiple of the 2 processes" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "odd").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_heals_on_cuda(setup, tmp_path):
    """One process on the GPU (the run picks CUDA where there is one), bf16 autocast where it has bf16 matmuls."""
    out = tmp_path / "cuda"
    r = run(heal_command(setup, 1, out, "--precision", "auto"))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "heal.json").read_text())
    assert summary["tokens"] > 0 and summary["healed"]["ppl"] < float("inf")
