"""Healing (train/heal/, train/teacher_cache.py) on a tiny converted model and a small real-text corpus:
the cache holds the original model's states at every layer boundary and refuses a corrupt or foreign
one; an exact conversion has no local error; both local modes lower each layer's error; the whole
run brings the student closer to the original; kill -9 resumes; bad input is refused in one line."""

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_train_fixtures import (  # noqa: F401 (fixture)
    SRC,
    build_corpus,
    byte_tokenizer,
    make_models,
    metrics,
    ood_texts,
    run_cli,
    tiny_vanilla,
)

from looplm.convert import convert, stepwise_layers
from looplm.data.corpus import PackedCorpus
from looplm.errors import UsageError
from looplm.models import load_model, save_model
from looplm.train.baselines import stepwise_model
from looplm.train.heal import (
    HealConfig,
    cached_rows,
    heal,
    prepare,
    relative_error,
    relative_error_log1p,
    streamed_rows,
)
from looplm.train.heal import plan as heal_plan
from looplm.train.heal import stages as heal_stages
from looplm.train.heal import steps as heal_steps
from looplm.train.heal.inputs import step_batch, teacher_spans
from looplm.train.losses import HIDDEN_LOSSES
from looplm.train.step_loop import replan_due
from looplm.train.teacher_cache import TeacherCache, build_cache, teacher_states
from looplm.util import cpu_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_torch_thread, ood_texts):  # noqa: F811 (the fixture)
    tmp = tmp_path_factory.mktemp("heal")
    models = make_models(tmp)
    return tmp, models, build_corpus(tmp, models["student"], seq_len=32)


def heal_config(setup, out, model=None, **kw) -> HealConfig:
    """The tests' healing run: the fixture's student (or ``model``) healed from its original on its corpus into
    ``out``, on small rows and batches, quietly; ``kw``: what the test varies."""
    _, models, corpus = setup
    small = dict(seq_len=32, cache_rows=16, local_batch=2, e2e_batch=2, eval_rows=4, progress=False)
    student = str(model or models["student"])
    return HealConfig(model=student, teacher=str(models["teacher"]), data=str(corpus), out=str(out), **{**small, **kw})


def heal_args(models, corpus, out, *extra):
    return [
        "heal",
        models["student"],
        "--teacher",
        models["teacher"],
        "--data",
        corpus,
        "--out",
        out,
        "--seq-len",
        32,
        "--cache-rows",
        16,
        "--local-batch",
        2,
        "--e2e-batch",
        2,
        "--eval-rows",
        4,
        "--no-progress",
        "--no-compile",
        *extra,
    ]


def test_relative_error_is_per_token():
    target = torch.tensor([[[3.0, 4.0], [300.0, 400.0]]])
    pred = target.clone()
    pred[0, 0, 0] += 5.0  # a 100% error on the small token, none on the large one
    assert relative_error(pred, target).item() == pytest.approx(0.5)


def test_log1p_hidden_error_matches_near_and_bounds_a_far_token():
    """--hidden-loss log1p: equal to the relative error where the student is close; a token 1,000x off (the
    massive activations of a few tokens) pulls with a gradient no larger than 1/||target||, where the
    squared error's grows with the distance."""
    target = torch.tensor([[[3.0, 4.0], [300.0, 400.0]]])
    near = target * (1 + 1e-3)
    assert relative_error_log1p(near, target).item() == pytest.approx(relative_error(near, target).item(), rel=1e-3)
    far = target.clone()
    far[0, 0] += torch.tensor([150.0, 0.0])  # relative error 900 on the small token
    for loss, bounded in ((relative_error_log1p, True), (relative_error, False)):
        pred = far.clone().requires_grad_()
        loss(pred, target).backward()
        pull = pred.grad[0, 0].norm().item() * 2  # the mean over two tokens halves each token's gradient
        assert (pull <= 1 / 5.0) == bounded, (loss.__name__, pull)


def test_cache_built_under_autocast_records_it_and_stays_close_to_float32(setup):
    """Healing builds its cache in the autocast its training passes use (bf16 where the CPU has bf16 matmuls):
    meta.json says what the states were computed in, and they stay within bf16's reach of the float32 ones.
    The setting is not part of the cache's key: either cache serves either run."""
    tmp, models, corpus_dir = setup
    teacher, _ = load_model(models["teacher"])
    corpus = PackedCorpus(corpus_dir)
    rows = np.array([0, 3, 5])
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    exact = build_cache(teacher, corpus, tmp / "cache-f32", rows, 32, progress=False, log=lambda *a: None)
    rounded = build_cache(
        teacher, corpus, tmp / "cache-bf16", rows, 32, progress=False, log=lambda *a: None, autocast=bf16
    )
    assert exact.meta["computed_in"] == "float32" and rounded.meta["computed_in"] == "bfloat16"
    L = teacher.config.num_hidden_layers
    for b in (1, L):
        err = relative_error(rounded.boundary(b, [0, 1, 2]), exact.boundary(b, [0, 1, 2])).item()
        assert 0 < err < 1e-3, (b, err)
    again = build_cache(teacher, corpus, tmp / "cache-bf16", rows, 32, progress=False, log=lambda *a: None)
    assert again.meta["sha256"] == rounded.meta["sha256"]  # reused by a float32 run, not rebuilt


def test_cache_holds_every_boundary_and_refuses_a_foreign_or_corrupt_one(setup):
    tmp, models, corpus_dir = setup
    teacher, _ = load_model(models["teacher"])
    corpus = PackedCorpus(corpus_dir)
    rows = np.array([0, 3, 5])
    cache = build_cache(teacher, corpus, tmp / "cache", rows, 32, progress=False, log=lambda *a: None)
    ids = cache.tokens(corpus, [0, 1, 2])
    assert torch.equal(ids, torch.from_numpy(np.asarray(corpus.splits["train"][rows], dtype=np.int64)))
    with torch.no_grad():
        h = teacher.model.embed(ids)
        assert torch.allclose(cache.boundary(0, [0, 1, 2]), h, rtol=1e-2, atol=1e-2)
        final, _, _ = teacher.model(ids)
        assert torch.allclose(cache.boundary(teacher.config.num_hidden_layers, [0, 1, 2]), final, rtol=1e-2, atol=1e-2)
        # every pair (input, output) of depth d is layer d's map, to bfloat16 rounding
        tables = teacher.model.rotary(torch.arange(32)[None].expand(3, -1), torch.float32)
        for d, layer in enumerate(teacher.model.layers):
            y = layer(cache.boundary(d, [0, 1, 2]), 0, *tables["full"], None)
            assert relative_error(y, cache.boundary(d + 1, [0, 1, 2])).item() < 1e-4
    # reused as it is
    stamp = (tmp / "cache" / "states.bin").stat().st_mtime_ns
    build_cache(teacher, corpus, tmp / "cache", rows, 32, progress=False, log=lambda *a: None)
    assert (tmp / "cache" / "states.bin").stat().st_mtime_ns == stamp
    # another teacher, other rows: refused, not overwritten
    with pytest.raises(UsageError, match="another teacher"):
        build_cache(tiny_vanilla(seed=1), corpus, tmp / "cache", rows, 32, progress=False, log=lambda *a: None)
    with pytest.raises(UsageError, match="another rows"):
        build_cache(teacher, corpus, tmp / "cache", np.array([1, 2, 3]), 32, progress=False, log=lambda *a: None)
    # a flipped byte fails the checksum; a truncated file is refused before reading
    data = bytearray((tmp / "cache" / "states.bin").read_bytes())
    data[100] ^= 0xFF
    (tmp / "cache" / "states.bin").write_bytes(bytes(data))
    with pytest.raises(UsageError, match="checksum"):
        TeacherCache(tmp / "cache")
    (tmp / "cache" / "states.bin").write_bytes(bytes(data[:-10]))
    with pytest.raises(UsageError, match="truncated"):
        TeacherCache(tmp / "cache")


def _first_local_errors(models, corpus, student, tmp_path):
    """A run prepared for ``student`` (4 cached rows), its cache, and each shared layer's local error before any
    step (on two cached rows)."""
    run = prepare(
        HealConfig(
            model=str(student),
            teacher=models["teacher"],
            data=str(corpus),
            out=str(tmp_path / "run"),
            train_tokens=64,
            seq_len=32,
            cache_rows=4,
            local_batch=2,
        )
    )
    inputs, m = run.inputs, run.inputs.student
    cache = build_cache(
        inputs.teacher, inputs.corpus, tmp_path / "cache", inputs.rows, 32, progress=False, log=lambda *a: None
    )
    errors = []
    for layer in range(m.config.num_shared_layers):
        opt = torch.optim.SGD(m.model.layers[layer].parameters(), lr=0.0)
        args = (m, layer, cache, inputs.spans, np.array([0, 1]), opt, {}, 0.0, inputs.autocast, inputs.device, 1.0)
        errors.append(heal_steps.local_step(*args))
    return run, cache, errors


def test_an_exact_conversion_has_no_local_error(setup, tmp_path):
    """Full-rank LoRA with per-depth norms is the original model: every depth's local error is bfloat16
    rounding, which checks that the cache pairs (input, output) with the right depth, slot and layer."""
    _, models, corpus = setup
    teacher, tok = load_model(models["teacher"])
    exact = convert(
        teacher.double(), loops=2, init="average", norms="per-depth", lora_ranks="full", lora_init="svd"
    ).float()
    student = save_model(exact, tok, tmp_path / "exact")
    run, cache, errors = _first_local_errors(models, corpus, student, tmp_path)
    assert max(errors) < 1e-4, errors


def test_each_depth_of_a_shallower_student_stands_for_a_span_of_the_original_layers():
    """A converted model's depth d stands for the original's layer d; the reduced-size model's depths for the layers
    from the one each copies up to the next copied one; a fresh one's for equal shares. A student no map fits (wider,
    deeper, or of a depth count that does not divide the original's, with no copied layers) is refused."""
    from looplm.models import LoopLMConfig

    def cfg(layers, hidden=64, conversion=None):
        return LoopLMConfig(vocab_size=260, hidden_size=hidden, num_hidden_layers=layers, conversion=conversion)

    teacher = cfg(30)
    assert teacher_spans(cfg(30), teacher) == [(d, d + 1) for d in range(30)]
    copied = stepwise_layers(30, 15)  # 0, 2, ..., 14, 17, ..., 29: the middle depth copies layer 14 and stands for 3
    spans = teacher_spans(cfg(15, conversion={"init": "stepwise-noloop", "layers": copied}), teacher)
    assert spans[0] == (0, 2) and spans[7] == (14, 17) and spans[-1] == (29, 30)
    assert [a for a, _ in spans[1:]] == copied[1:] and all(b == a for (_, b), (a, _) in zip(spans, spans[1:]))
    scratch = cfg(10, conversion={"init": "scratch", "layers": list(range(10))})
    assert teacher_spans(scratch, teacher) == [(3 * d, 3 * d + 3) for d in range(10)]
    for student, message in (
        (cfg(31), "no conversion or reduced-size"),
        (cfg(30, hidden=32), "width 32"),
        (cfg(7), "no depth-to-layers map"),
    ):
        with pytest.raises(UsageError, match=message):
            teacher_spans(student, teacher)


def test_a_reduced_size_model_heals_on_its_spans(setup, tmp_path):
    """The reduced-size model of the tiny original (its layers 0 and 3, run once): the depth copying the last layer
    stands for it alone, so its local error starts at bfloat16 rounding, while the first depth stands for layers
    0-2 and does not; a run of `looplm heal` brings the model closer to the original."""
    _, models, corpus = setup
    teacher, tok = load_model(models["teacher"])
    reduced = save_model(stepwise_model(teacher, loops=2), tok, tmp_path / "reduced")
    run, cache, errors = _first_local_errors(models, corpus, reduced, tmp_path)
    inputs, m = run.inputs, run.inputs.student
    assert inputs.spans == [(0, 3), (3, 4)]
    assert errors[1] < 1e-4 < 0.05 < errors[0], errors
    # end to end: the distillation target is the original's output, each depth's state the end of its span
    ids = cache.tokens(inputs.corpus, [0, 1])
    states = teacher_states(inputs.teacher, ids)
    heal_steps.body_params(m, run.cfg.base_weights)  # as the stage trains it: the head frozen
    loss, parts = heal_steps.e2e_loss(m, inputs.teacher, ids, states.__getitem__, inputs.spans, run.cfg, nullcontext)
    with torch.no_grad():
        t, s = (F.log_softmax(model(ids).logits.float(), -1) for model in (inputs.teacher, m))
        _, depth_states, _ = m.model(ids, output_depth_states=True)
    assert parts["kd"].item() == pytest.approx(float((t.exp() * (t - s)).sum(-1).mean()), rel=2e-2)
    error = HIDDEN_LOSSES[run.cfg.hidden_loss]
    hidden = (error(depth_states[0], states[3]) + error(depth_states[1], states[4])) / 2
    assert parts["hidden"].item() == pytest.approx(hidden.item(), rel=1e-4)
    out = tmp_path / "healed"
    args = heal_args(models, corpus, out, "--train-tokens", 64 * 40, "--local-lr", 3e-3, "--e2e-lr", 1e-3)
    args[1] = reduced
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert _student_gap(models, out / "final", corpus) < _student_gap(models, reduced, corpus)


def _student_gap(models, model_dir, corpus_dir):
    """Mean KL(original || student) over the corpus's held-out rows, and the mean per-depth relative error."""
    teacher, _ = load_model(models["teacher"])
    student, _ = load_model(model_dir)
    held = torch.from_numpy(np.asarray(PackedCorpus(corpus_dir).splits["heldout"][:8], dtype=np.int64))
    with torch.no_grad():
        t = F.log_softmax(teacher(held).logits, -1)
        s = F.log_softmax(student(held).logits, -1)
    return float((t.exp() * (t - s)).sum(-1).mean())


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_local_stage_lowers_every_layers_error(setup, mode):
    tmp, models, corpus = setup
    out = tmp / f"local-{mode}"
    cfg = heal_config(
        setup,
        out,
        train_tokens=64 * 40,
        local_share=1.0,
        local_mode=mode,
        local_lr=3e-3,
        cache=str(tmp / f"cache-{mode}"),
    )
    r = heal(cfg, log=lambda *a: None)
    visits = metrics(out)
    visits = [v for v in visits if v.get("stage") == "local"]
    assert len(visits) == (4 if mode == "sequential" else 2)
    assert all(v["err_last"] < v["err_first"] for v in visits)
    # a random tiny original is near-uniform (perplexity ~ its vocabulary), so closeness is measured as KL
    assert r["healed"]["eval_tokens"] > 0 and r["converted"]["eval_tokens"] > 0
    assert _student_gap(models, out / "final", corpus) < _student_gap(models, models["student"], corpus)
    assert (out / "heal.png").stat().st_size > 0


def test_kill9_resumes_and_heals(setup):
    tmp, models, corpus = setup
    out = tmp / "killed"
    args = heal_args(models, corpus, out, "--train-tokens", 64 * 60, "--local-lr", 3e-3, "--e2e-lr", 1e-3)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "looplm", *map(str, args)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 200
    while time.time() < deadline and not (out / "latest").exists():
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()
    stamp = (out / "cache" / "states.bin").stat().st_mtime_ns
    r = run_cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout and "healed" in r.stdout
    assert (out / "cache" / "states.bin").stat().st_mtime_ns == stamp  # the cache was reused, not rebuilt
    summary = json.loads((out / "heal.json").read_text())
    # 3,840 tokens: half local (30 steps of 2 rows x 2 depths), of the rest 90% end to end (27 steps), 10%
    # exit adapters (3 steps); the summary's tokens are both stages' (the budget's share after the local stage)
    assert summary["tokens"] == (27 + 3) * 2 * 32 and summary["local_tokens"] == 30 * 2 * 32 * 2
    assert summary["machines"] == [cpu_model()]  # resumed on the machine it began on: named once
    records = metrics(out)
    exits = [r for r in records if r.get("stage") == "exit"]
    assert [r["step"] for r in exits] == [1, 2, 3]
    assert [r["tokens"] for r in exits] == [(27 + i) * 2 * 32 for i in (1, 2, 3)]
    assert _student_gap(models, out / "final", corpus) < _student_gap(models, models["student"], corpus)
    # the healed model is a looplm model the other commands read
    model, _ = load_model(out / "final")
    assert model.config.num_loops == 2
    # only two complete checkpoints kept, none half-written
    assert len([p for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")]) <= 2
    # a run started before --base-weights existed resumes with its default (checked last: it
    # resumes the finished run again)
    run = json.loads((out / "run.json").read_text())
    del run["config"]["base_weights"]
    (out / "run.json").write_text(json.dumps(run))
    r = run_cli(*args, "--resume")
    assert r.returncode == 0 and "different settings" not in r.stderr, r.stderr


def test_exit_stage_trains_the_adapter_and_leaves_the_body(setup, monkeypatch):
    """The exit stage adds an affine adapter per intermediate exit and trains it alone: the final loop's
    held-out perplexity is the same before and after it (so the run does not evaluate the end-to-end stage's end:
    the final evaluation gives it), the exit's distance to the final output falls, and the healed model is saved
    with its adapter."""
    tmp, models, corpus = setup
    exit_stage, seen = heal_stages.exit_stage, {}

    def evaluated_first(run):
        seen["before"] = run.evaluate(run.inputs.student)  # the body as the end-to-end stage left it
        exit_stage(run)

    monkeypatch.setattr(heal_stages, "exit_stage", evaluated_first)
    out = tmp / "exit-stage"
    cfg = heal_config(
        setup,
        out,
        train_tokens=64 * 40,
        local_share=0.0,
        exit_share=0.5,
        exit_lr=1e-2,
        cache=str(tmp / "cache-exit"),
    )
    r = heal(cfg, log=lambda *a: None)
    records = metrics(out)
    exits = [x for x in records if x.get("stage") == "exit"]
    assert len(exits) == 20 and len([x for x in records if x.get("stage") == "e2e"]) == 20
    assert sum(x["exit1"] for x in exits[-4:]) < sum(x["exit1"] for x in exits[:4])
    assert not [x for x in records if x.get("eval") and x["tag"] == "e2e"]
    assert r["healed"]["ppl_per_loop"][-1] == pytest.approx(seen["before"]["ppl_per_loop"][-1], rel=1e-6)
    assert r["exit_adapter"] == {"kind": "affine"}
    healed, _ = load_model(out / "final")
    assert healed.config.exit_adapter == {"kind": "affine"} and healed.exit_adapter.weight.abs().sum() > 0


@pytest.mark.parametrize("target", ["teacher", "final"])
def test_the_exit_term_matches_its_target_and_trains_the_body(setup, target):
    """--exit-weight: an end-to-end step adds forward KL of the exit after loop 1 against the original's output
    (--exit-target teacher) or the student's own full-depth output (final), whose logits get no gradient from
    it: the logged term is that KL computed from the logits, and the step moves the shared body."""
    from looplm.train.losses import kd_loss

    tmp, models, corpus = setup
    cfg = heal_config(
        setup,
        tmp / f"exit-term-{target}",
        train_tokens=64 * 4,
        local_share=0.0,
        exit_share=0.0,
        exit_weight=1.0,
        exit_target=target,
        e2e_rows="online",
        precision="fp32",
        cache_rows=4,
        cache=str(tmp / "cache-exit-term"),
    )
    inputs = prepare(cfg, log=lambda *a: None).inputs
    model = inputs.student
    ids, boundary = step_batch(inputs, None, cfg, 0, "e2e")  # online rows: no cache read
    K = model.config.num_shared_layers
    with torch.no_grad():
        _, states, _ = model.model(ids, output_depth_states=True)
        exit1 = model.exit_logits(states[K - 1], 0)
        want = (
            model.exit_logits(states[-1])
            if target == "final"
            else inputs.teacher.lm_head(inputs.teacher.exit_states(boundary(inputs.teacher.config.num_hidden_layers)))
        )
    before = [p.detach().clone() for p in model.model.layers.parameters()]
    params = heal_steps.body_params(model, cfg.base_weights)
    parts = heal_steps.e2e_step(inputs, None, cfg, model, 0, torch.optim.SGD(params, lr=1e-2), 1e-2)
    assert parts["kd_exit1"] == pytest.approx(float(kd_loss(exit1, want)), rel=1e-4)
    assert parts["loss"] == pytest.approx(parts["kd"] + parts["hidden"] + parts["kd_exit1"], rel=1e-5)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.model.layers.parameters()))
    with pytest.raises(UsageError, match="--exit-target"):
        prepare(HealConfig(**{**cfg.__dict__, "exit_target": "bogus", "out": str(tmp / "bogus")}), log=lambda *a: None)


def test_online_rows_read_the_whole_training_split_with_the_originals_states(setup):
    """--e2e-rows online: each end-to-end step reads the next rows of a seeded pass over every training row
    (not the cached few) with the original model's states computed on them, which match what the cache would
    hold for the same rows; the exit stage reads from half way; the run heals and is refused on resume with
    the other row source."""
    tmp, models, corpus = setup
    out = tmp / "online"
    cfg = heal_config(
        setup,
        out,
        train_tokens=64 * 40,
        local_share=0.0,
        e2e_rows="online",
        e2e_lr=1e-3,
        cache_rows=4,
        cache=str(tmp / "cache-online"),
    )
    inputs = prepare(cfg, log=lambda *a: None).inputs
    train = inputs.corpus.splits["train"]
    stream = streamed_rows(inputs.corpus, cfg.seed)
    held = {bytes(np.asarray(r)) for r in inputs.corpus.splits["heldout"]}
    # every training row but those that repeat a held-out row (this tiny corpus repeats its text)
    assert sorted(stream.tolist()) == [r for r in range(len(train)) if bytes(np.asarray(train[r])) not in held]
    assert len(stream) > 4 * len(inputs.rows)
    seen = []
    for step in range(3):
        ids, boundary = step_batch(inputs, None, cfg, step, "e2e")
        rows = stream[step * 2 : step * 2 + 2]
        seen += rows.tolist()
        assert torch.equal(ids, torch.from_numpy(np.asarray(train[rows][:, :32], dtype=np.int64)))
        L = inputs.teacher.config.num_hidden_layers
        with inputs.autocast():  # the stage runs the original at the training precision
            want = teacher_states(inputs.teacher, ids)
        assert all(torch.equal(boundary(b), want[b].float()) for b in (0, L // 2, L))
    assert len(set(seen)) == 6 and not set(seen) <= set(inputs.rows.tolist())
    ids, _ = step_batch(inputs, None, cfg, 0, "exit")
    half = stream[len(stream) // 2 : len(stream) // 2 + 2]
    assert torch.equal(ids, torch.from_numpy(np.asarray(train[half][:, :32], dtype=np.int64)))
    # the cache's states of a row are the states computed online (bf16 rounding apart)
    cache = build_cache(
        inputs.teacher, inputs.corpus, tmp / "cache-online", inputs.rows, 32, progress=False, log=lambda *a: None
    )
    ids = cache.tokens(inputs.corpus, [0, 1])
    online = teacher_states(inputs.teacher, ids)
    assert all(relative_error(online[b], cache.boundary(b, [0, 1])) < 1e-4 for b in (1, L))

    r = heal(cfg, log=lambda *a: None)
    steps = metrics(out)
    assert len([x for x in steps if x.get("stage") == "e2e"]) == 36
    assert _student_gap(models, out / "final", corpus) < _student_gap(models, models["student"], corpus)
    assert r["healed"]["eval_tokens"] > 0
    r = run_cli(
        *heal_args(
            models, corpus, out, "--train-tokens", 64 * 40, "--local-share", 0, "--e2e-rows", "cache", "--resume"
        )
    )
    assert r.returncode == 2 and "e2e_rows: 'online' -> 'cache'" in r.stderr, r.stderr


def test_rounded_base_weights_stay_on_their_grid_while_the_rest_learns(setup):
    """--base-weights int4: the shared weights are rounded by GPTQ before the first stage and stay frozen on
    the int4 grid through both stages (quantizing the result rounds nothing new); the LoRA and norms learn."""
    from looplm.models import quantized as Q

    tmp, models, corpus = setup
    out = tmp / "int4-base"
    cfg = heal_config(
        setup,
        out,
        train_tokens=64 * 40,
        local_lr=3e-3,
        e2e_lr=1e-3,
        exit_adapter="none",
        base_weights="int4",
        cache=str(tmp / "cache-int4"),
    )
    heal(cfg, log=lambda *a: None)
    before, _ = load_model(models["student"])
    after, _ = load_model(out / "final")
    shared = dict(Q.linears(after))
    for name, lin in Q.linears(before):
        w = shared[name].weight
        assert Q.relative_error(w, "int4") < 1e-6  # on its grid: serving it as int4 rounds nothing new
        assert Q.relative_error(lin.weight, "int4") > 1e-3 and not torch.allclose(w, lin.weight)
        assert not torch.equal(shared[name].lora_B, lin.lora_B)  # the LoRA learned around the rounding
    assert not torch.equal(after.model.layers[0].attn_norm.weight, before.model.layers[0].attn_norm.weight)
    assert _student_gap(models, out / "final", corpus) < _student_gap(models, models["student"], corpus)


def test_bad_input_is_refused_in_one_line(setup, tmp_path):
    tmp, models, corpus = setup
    cases = [
        (["--budget-minutes", 0], "budget must be positive"),
        (["--train-tokens", -5], "budget must be positive"),
        (["--train-tokens", 100, "--exit-share", 1.5], "--exit-share 1.5 must be a fraction"),
        (["--train-tokens", 100, "--exit-adapter", "conv"], "unknown exit adapter kind"),
    ]
    for extra, message in cases:
        r = run_cli(*heal_args(models, corpus, tmp_path / "bad", *extra))
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for flag, value in (("--local-mode", "diagonal"), ("--base-weights", "int3"), ("--hidden-loss", "l1")):
        r = run_cli(*heal_args(models, corpus, tmp_path / "bad", "--train-tokens", 100, flag, value))
        assert r.returncode == 2 and f"argument {flag}: invalid choice: '{value}'" in r.stderr, r.stderr
    # a teacher with another vocabulary
    other = save_model(tiny_vanilla(vocab=262), byte_tokenizer("<a> <b>"), tmp_path / "other")
    args = heal_args(models, corpus, tmp_path / "bad2", "--train-tokens", 100)
    args[3] = other
    r = run_cli(*args)
    assert r.returncode == 2 and "different tokenizers" in r.stderr, r.stderr
    # a corrupt cache given with --cache
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "meta.json").write_text("{not json")
    r = run_cli(*heal_args(models, corpus, tmp_path / "bad3", "--train-tokens", 100, "--cache", tmp_path / "cache"))
    assert r.returncode == 2 and "corrupt" in r.stderr, r.stderr
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


@pytest.mark.parametrize(
    "budget, compiled",
    [
        ({"train_tokens": 99_999}, False),
        ({"train_tokens": 100_000}, True),
        ({"budget_minutes": 9}, False),
        ({"budget_minutes": 10}, True),
    ],
)
def test_heal_compiles_from_ten_minutes_or_100k_tokens_where_a_compiler_is(tmp_path, monkeypatch, budget, compiled):
    from looplm.recipes import heal as recipe

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(recipe, "cpu_compiler", lambda: "cc")
    s = HealConfig(model=str(tmp_path), teacher="t", data="d", out="o", **budget)
    assert recipe.fill_recipe_defaults(s) == ["compiled" if compiled else "not compiled"] and s.compile is compiled
    monkeypatch.setattr(recipe, "cpu_compiler", lambda: None)
    s = HealConfig(model=str(tmp_path), teacher="t", data="d", out="o", **budget)
    recipe.fill_recipe_defaults(s)
    assert s.compile is (compiled and torch.cuda.is_available())  # no compiler: only CUDA's triton


def test_heal_fills_what_the_command_line_leaves_out_and_says_so(setup, tmp_path):
    """Without --teacher the conversion's recorded source teaches; without --out the run goes to out/<model>-healed;
    a time budget defaults to the recipe's hour (compiled), and a token budget compiles from COMPILE_TOKENS on (this
    one, below, stays uncompiled); the choices are printed. A model that records no source, or is no converted
    directory, is refused in one line that names the fix."""
    tmp, models, corpus = setup
    student = tmp_path / "student"
    shutil.copytree(models["student"], student)
    config = json.loads((student / "config.json").read_text())
    config["conversion"]["source"] = str(models["teacher"])
    (student / "config.json").write_text(json.dumps(config))
    args = [a for a in heal_args(models, corpus, "unused", "--train-tokens", 64 * 16) if a != "--no-compile"]
    args = args[:1] + [student] + args[4:]  # no --teacher
    out_at = args.index("--out")
    del args[out_at : out_at + 2]  # no --out
    r = subprocess.run(
        [sys.executable, "-m", "looplm", *map(str, args)], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert r.returncode == 0, r.stderr
    chosen = next(line for line in r.stderr.splitlines() if line.startswith("looplm heal: teacher"))
    assert chosen == (
        f"looplm heal: teacher {models['teacher']} (the model it was converted from), "
        "out out/student-healed, not compiled"
    )
    run = json.loads((tmp_path / "out" / "student-healed" / "run.json").read_text())["config"]
    assert run["teacher"] == str(models["teacher"]) and run["train_tokens"] == 64 * 16 and run["compile"] is False
    assert (tmp_path / "out" / "student-healed" / "final" / "config.json").exists()

    r = run_cli(
        *heal_args(models, corpus, tmp_path / "no-source", "--train-tokens", 100)[:2],
        *heal_args(models, corpus, tmp_path / "no-source", "--train-tokens", 100)[4:],
    )
    assert r.returncode == 2 and "records no model it was converted from" in r.stderr, r.stderr
    r = run_cli(
        *heal_args(models, corpus, tmp_path / "none", "--train-tokens", 100)[:1],
        tmp_path / "nowhere",
        *heal_args(models, corpus, tmp_path / "none", "--train-tokens", 100)[2:],
    )
    assert r.returncode == 2 and "make one with `looplm convert` first" in r.stderr, r.stderr


def replans(total: int, refix=lambda step, total: total) -> list[int]:
    """The steps ``replan_due`` fixes the count at, the count changed by ``refix`` at each fix."""
    done, s = [], 0
    while s < total:
        if replan_due(s, total, done):
            done.append(s)
            total = refix(s, total)
        s += 1
    return done


def test_a_time_budget_is_replanned_after_warm_up_and_late_in_the_stage(setup):
    """The end-to-end step count is fixed again after steps 3 and 30 and at a half, three quarters and nine tenths
    of the count (each once, in order, skipping those the count has passed), from the steps since the previous fix;
    the run then takes exactly the count last fixed."""
    assert replans(100) == [3, 30, 50, 75, 90]
    assert replans(2) == [] and replans(35) == [3, 30, 32]  # the shares at or before step 30 are passed
    # a count that grows at a fix moves the shares after it, one that shrinks skips those it passed; each share
    # is used once (a count growing by a few steps at nine tenths does not ask for a fix two steps later)
    assert replans(100, lambda s, t: 200 if s == 50 else t) == [3, 30, 50, 150, 180]
    assert replans(200, lambda s, t: 110 if s == 100 else t) == [3, 30, 100]
    assert replans(200, lambda s, t: 130 if s == 100 else t) == [3, 30, 100, 117]
    assert replans(500, lambda s, t: t + 3 if s > 30 else t) == [3, 30, 250, 378, 456]
    tmp, models, corpus = setup
    out = tmp / "budget"
    # rows from the cache: the shorter steps give the 15 seconds enough of them to check the late fixes
    r = run_cli(*heal_args(models, corpus, out, "--budget-minutes", 0.25, "--local-share", 0.1, "--e2e-rows", "cache"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "run.json").read_text())["plan"]
    steps = [x["step"] for x in metrics(out) if x.get("stage") == "e2e" and not x.get("eval")]
    assert plan["e2e_steps"] > 60, "too few steps to check the late fixes"
    fixed = plan["e2e_replanned_at"]
    assert fixed[:2] == [3, 30] and fixed == sorted(fixed) and 3 <= len(fixed) <= 5 and fixed[-1] < plan["e2e_steps"]
    assert steps == list(range(1, plan["e2e_steps"] + 1))
    # the local visits were replanned too: every visit ran the count stored for it, and the stage's tokens add up
    visits = [x for x in metrics(out) if x.get("stage") == "local"]
    by_visit = plan["local_steps_by_visit"]
    assert len(by_visit) == len(visits) == plan["visits"] and min(by_visit) >= 1
    assert 0 < plan["local_end_seconds"] < 0.25 * 60
    assert visits[-1]["local_tokens"] == sum(by_visit) * 2 * 32


def test_the_exit_stage_fills_its_share_of_the_budget_when_the_plan_timed_its_steps_too_slow(setup, monkeypatch):
    """The plan times an exit-adapter step before anything is warm (steps after compiling run much faster).
    The exit stage fixes its count again from its own first steps, as the end-to-end stage does,
    so it trains for the seconds the plan gave it rather than for the count of a slow guess."""
    tmp, models, corpus = setup
    timed = heal_plan.time_steps
    monkeypatch.setattr(heal_plan, "time_steps", lambda *a: (lambda t: (t[0], t[1], t[2] * 20))(timed(*a)))
    logs = []
    out = tmp / "exit-replan"
    cfg = heal_config(
        setup,
        out,
        budget_minutes=0.3,
        local_share=0.1,
        exit_share=0.5,
        e2e_rows="cache",
        precision="fp32",
        ood_windows=0,
    )
    heal(cfg, log=logs.append)
    planned = int(next(m for m in logs if m.startswith("plan:")).rsplit(", ", 1)[1].split()[0])
    plan = json.loads((out / "run.json").read_text())["plan"]
    steps = [x["step"] for x in metrics(out) if x.get("stage") == "exit" and not x.get("eval")]
    assert planned > 3, "too few planned exit steps to fix the count again"
    assert plan["exit_replanned_at"][0] == 3 and plan["exit_steps"] > 5 * planned
    assert steps == list(range(1, plan["exit_steps"] + 1))


def test_a_run_killed_before_its_first_checkpoint_resumes_on_the_budget_it_had_spent(setup):
    """The teacher cache and the plan are kept by a kill before the first checkpoint, so the time they took stays
    spent: the resumed run's clock starts where the plan left it (run.json's plan_clock), not at zero."""
    tmp, models, corpus = setup
    out = tmp / "killed-before-checkpoint"
    args = heal_args(models, corpus, out, "--budget-minutes", 0.1, "--local-share", 0.5)
    assert run_cli(*args).returncode == 0
    run = json.loads((out / "run.json").read_text())
    assert run["plan_clock"] > 0
    # what a kill before the first checkpoint leaves: run.json with the plan, the cache, the first records
    for p in ("checkpoints", "local-end", "final"):
        shutil.rmtree(out / p)
    for p in ("latest", "heal.json"):
        (out / p).unlink()
    r = run_cli(*args, "--resume")
    assert r.returncode == 0, r.stderr
    assert "after its plan" in r.stdout and (out / "final").exists()
    steps = [x for x in metrics(out) if not x.get("eval")]
    assert steps and all(x["time"] >= run["plan_clock"] for x in steps)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_host_memory_is_kept_instead_of_faulted_in_again():
    """keep_freed_host_memory (called by `looplm heal` on CPU): a 64 MiB block freed and allocated again, as a
    training step's largest ones are, comes back without page faults once the heap holds it, where glibc's defaults
    unmap it and fault it in again every time. Each setting in its own process."""
    probe = (
        "import sys, torch\n"
        "from looplm.util import keep_freed_host_memory\n"
        "applied = keep_freed_host_memory() if sys.argv[1] == 'keep' else None\n"
        "def faults():\n"
        "    return int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[7])\n"
        "for _ in range(12):\n"  # the heap grows until a freed block fits the next (1-5 rounds measured)
        "    torch.ones(16 << 20)\n"  # 64 MiB, freed at once
        "before = faults()\n"
        "for _ in range(4):\n"
        "    torch.ones(16 << 20)\n"
        "print(applied, faults() - before)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = {
        v: subprocess.run(
            [sys.executable, "-c", probe, v], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        for v in ("default", "keep")
    }
    assert out["keep"][0] == "True"
    assert int(out["default"][1]) > 4 * 15_000  # 16,384 pages of 4 KiB faulted in again each time
    assert int(out["keep"][1]) < 1_000


def test_local_visits_are_replanned_to_end_at_the_local_share():
    """The visits left share the time to the local stage's planned end, at the speed of the visit just timed
    (the run stores the plan in run.json: test_a_time_budget_is_replanned_after_warm_up_and_late_in_the_stage)."""
    logs = []
    plan = {"local_steps_by_visit": [50, 50, 50, 50], "local_end_seconds": 100.0, "local_steps_per_visit": 50}
    cfg = HealConfig(local_batch=2, seq_len=32)
    heal_plan.replan_local(plan, 1, 2.0, 40.0, cfg, 4, logs.append)  # 60 s left for 3 visits at 2 s a step: 10 each
    assert plan["local_steps_by_visit"] == [50, 10, 10, 10] and "10 steps a visit" in logs[0]
    assert plan["local_steps_per_layer"] == 20 and plan["local_tokens_per_layer"] == 20 * 2 * 32
    heal_plan.replan_local(plan, 3, 2.0, 120.0, cfg, 4, logs.append)  # past the end: one step a visit, never none
    assert plan["local_steps_by_visit"] == [50, 10, 10, 1]


def test_the_cache_holds_the_rows_cached_rows_draws(setup):
    """`cached_rows` names the training rows a run trained on (the rows its cache holds), so that they can be
    told from rows it never read."""
    tmp, models, corpus = setup
    out = tmp / "overfit"
    heal(
        heal_config(
            setup,
            out,
            train_tokens=64 * 4,
            e2e_rows="cache",
        ),
        log=lambda *a: None,
    )
    held = TeacherCache(out / "cache").rows
    assert list(cached_rows(len(PackedCorpus(corpus).splits["train"]), 16, 0)) == list(held)


def test_a_run_that_did_not_record_a_changed_default_resumes_with_the_value_it_ran(setup, tmp_path):
    """--hidden-loss became log1p and --e2e-rows online by default; a run from before they were recorded ran with
    relative and cache, and --resume keeps it to them (HealConfig.FORMER_DEFAULTS)."""
    tmp, models, corpus = setup
    out = tmp_path / "old"
    args = ["--train-tokens", 64 * 8, "--exit-adapter", "none"]
    old = ["--hidden-loss", "relative", "--e2e-rows", "cache"]
    r = run_cli(*heal_args(models, corpus, out, *args, *old))
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "run.json").read_text())
    del run["config"]["hidden_loss"], run["config"]["e2e_rows"]
    (out / "run.json").write_text(json.dumps(run))
    r = run_cli(*heal_args(models, corpus, out, *args, "--resume"))
    assert r.returncode == 2 and "hidden_loss: 'relative' -> 'log1p'" in r.stderr, r.stderr
    assert "e2e_rows: 'cache' -> 'online'" in r.stderr, r.stderr
    r = run_cli(*heal_args(models, corpus, out, *args, *old, "--resume"))
    assert r.returncode == 0, r.stderr


def test_compiled_training_stages_take_the_eager_steps(setup, monkeypatch):
    """--compile: the local and end-to-end stages run each layer of the student (and the original) through
    torch.compile, and take the steps the eager run takes (float32: the same losses and final evaluation to
    rounding). Without a C++ compiler it is refused in one line before the run directory is made."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from looplm import util

    tmp, models, corpus = setup
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    records = {}
    for compiled in (False, True):
        out = tmp / f"compile-{compiled}"
        cfg = heal_config(
            setup,
            out,
            train_tokens=64 * 6,
            local_share=0.5,
            e2e_rows="online",
            e2e_lr=1e-3,
            exit_adapter="none",
            precision="fp32",
            compile=compiled,
            cache_rows=4,
            cache=str(tmp / "cache-compile"),
        )
        torch._dynamo.reset()
        counters.clear()
        heal(cfg, log=lambda *a: None)
        records[compiled] = metrics(out)
        assert (counters["stats"]["unique_graphs"] > 0) == compiled
    local = {k: [r for r in recs if r.get("stage") == "local"] for k, recs in records.items()}
    assert len(local[True]) == len(local[False]) > 0
    for a, b in zip(local[False], local[True]):
        assert b["err_last"] == pytest.approx(a["err_last"], rel=1e-4)
    e2e = {k: [r for r in recs if r.get("stage") == "e2e"] for k, recs in records.items()}
    assert len(e2e[True]) == len(e2e[False]) == 3
    for a, b in zip(e2e[False], e2e[True]):
        assert b["kd"] == pytest.approx(a["kd"], rel=1e-4) and b["hidden"] == pytest.approx(a["hidden"], rel=1e-4)
    final = {k: [r for r in recs if r.get("eval") and r["tag"] == "final"][0]["ppl"] for k, recs in records.items()}
    assert final[True] == pytest.approx(final[False], rel=1e-4)
    monkeypatch.setattr(util.shutil, "which", lambda name: None)
    cfg.out = str(tmp / "compile-no-compiler")
    with pytest.raises(UsageError, match="C\\+\\+ compiler"):
        prepare(cfg, log=lambda *a: None)
    assert not (tmp / "compile-no-compiler").exists()


def test_e2e_weight_average_is_evaluated_beside_the_weights_ends_the_stage_and_resumes(setup, monkeypatch):
    """--e2e-average: each end-to-end evaluation scores the weights and their moving average; the stage ends on
    the average (the final model's exits score what its last average scored), and a run stopped in the middle of
    the stage resumes with the average it had saved: the same final model as a run never stopped."""
    tmp, models, corpus = setup
    finals = {}
    for stopped in (False, True):
        out = tmp / f"average-{stopped}"
        cfg = heal_config(
            setup,
            out,
            train_tokens=64 * 16,
            local_share=0.25,
            e2e_lr=1e-3,
            e2e_average=0.8,
            exit_adapter="none",
            precision="fp32",
            eval_every_seconds=0.0,
            save_every_seconds=0.0,
            cache=str(tmp / "cache-average"),
        )
        if stopped:
            step = heal_steps.e2e_step
            calls = []

            def stop_after_five(*a, **k):
                calls.append(1)
                if len(calls) > 5:
                    raise KeyboardInterrupt
                return step(*a, **k)

            monkeypatch.setattr(heal_steps, "e2e_step", stop_after_five)
            with pytest.raises(KeyboardInterrupt):
                heal(cfg, log=lambda *a: None)
            monkeypatch.setattr(heal_steps, "e2e_step", step)
            latest = out / "checkpoints" / (out / "latest").read_text().strip()
            assert set(torch.load(latest / "training.pt")) == {"optimizer", "average"}
            cfg.resume = True
        r = heal(cfg, log=lambda *a: None)
        records = metrics(out)
        averaged = [x for x in records if x.get("eval") and x["tag"] == "e2e-average"]
        weights = [x for x in records if x.get("eval") and x["tag"] == "e2e"]
        assert len(averaged) >= 2 and len(weights) >= 2
        assert averaged[-1]["ppl"] != weights[-1]["ppl"]  # the average is not the weights' own end
        assert r["healed"]["ppl"] == pytest.approx(averaged[-1]["ppl"], rel=1e-6)
        finals[stopped] = load_model(out / "final")[0].state_dict()
    for name, value in finals[False].items():
        assert torch.allclose(finals[True][name], value, rtol=1e-5, atol=1e-6), name


def test_a_plan_with_unique_layers_heals_its_shared_blocks_locally_and_everything_end_to_end(setup):
    """Middle-cycle (1 + 1 x 2 + 1): the layer-local stage visits the one shared block only (the unique layers are
    the original's own); the end-to-end and exit stages train through the coda, and the healed model is closer to
    the original than the converted one."""
    tmp, models, corpus = setup
    teacher, tok = load_model(models["teacher"])
    student = save_model(
        convert(teacher, loops=2, strategy="middle-cycle", init="average", lora_ranks=4, lora_init="svd"),
        tok,
        tmp / "middle",
    )
    out = tmp / "heal-middle"
    cfg = heal_config(
        setup,
        out,
        model=student,
        train_tokens=64 * 40,
        local_share=0.5,
        exit_share=0.3,
        local_lr=3e-3,
        cache=str(tmp / "cache-middle"),
    )
    r = heal(cfg, log=lambda *a: None)
    records = metrics(out)
    assert len([x for x in records if x.get("stage") == "local"]) == 1  # one visit: the shared block
    assert [x for x in records if x.get("stage") == "e2e"] and [x for x in records if x.get("stage") == "exit"]
    assert r["exit_adapter"] == {"kind": "affine"}
    healed, _ = load_model(out / "final")
    assert healed.config.plan.describe() == "1 + 1 x 2 + 1 (cycle core)"
    assert _student_gap(models, out / "final", corpus) < _student_gap(models, student, corpus)
