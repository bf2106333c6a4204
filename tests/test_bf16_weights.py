"""``--weights bf16`` (models/quantized.py ``to_bf16``): the whole model in bfloat16, offered only where the
hardware multiplies bfloat16 natively, served by the engine without packed copies at half the float32 bytes,
and refused in one line where it cannot run or cannot apply."""

import copy

import pytest
import torch
from conftest import arrive_one_per_step
from conftest import small_relaxed as _relaxed

from looplm.bench.serving import agreement
from looplm.commands import main
from looplm.errors import UsageError
from looplm.models import quantized as Q
from looplm.serve import Engine, Request, make_scheduler
from looplm.serve.exits import parse_policy


def _cpu_bf16(monkeypatch, present: bool):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: present)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present)


def test_bf16_is_offered_only_where_the_hardware_multiplies_it(monkeypatch, capsys):
    _cpu_bf16(monkeypatch, False)
    assert "bf16" not in Q.supported_formats("cpu")
    with pytest.raises(UsageError, match="--weights bf16 cannot run on cpu.*supported here: fp32"):
        Q.prepare(_relaxed(), "bf16")
    # the command: one line, exit code 2, before any model loads
    assert main(["generate", "no-such-model", "x", "--weights", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bf16" in err and "supported here: fp32" in err
    _cpu_bf16(monkeypatch, True)
    assert Q.supported_formats("cpu")[-1] == "bf16"


def test_bf16_weights_serve_the_whole_model_at_half_the_bytes(monkeypatch):
    _cpu_bf16(monkeypatch, True)  # the arithmetic is the same on any CPU; only its speed needs the instructions
    model = _relaxed()
    param_bytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    served = Q.prepare(copy.deepcopy(model), "bf16")
    assert all(p.dtype == torch.bfloat16 for p in served.parameters()) and Q.stored_format(served) == "bf16"
    assert param_bytes(served) * 2 == param_bytes(model) and Q.weight_bytes(served) < Q.weight_bytes(model) / 1.9
    # the rotary frequencies stay float32 (rounded to bfloat16, position 500's angles would move by up to a radian)
    assert all(b.dtype == torch.float32 for b in served.model.rotary.buffers())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 11, 1, 8)]
    for scheduler, policy in (("sequence", None), ("depth", None), ("depth", "margin:0.05")):
        engine = Engine(served, max_batch=3, max_seq_len=64, exit_policy=policy and parse_policy(policy).bind(served))
        sched = make_scheduler(scheduler, engine)
        reqs = [Request(p, 7) for p in prompts]
        arrive_one_per_step(sched, reqs)
        assert engine.packed_bytes == 0 and all(len(r.output) == 7 for r in reqs)
        if policy is None:  # full depth: the float32 model's greedy choices, teacher-forced on the bf16 engine's output
            with torch.no_grad():
                assert agreement(model, reqs) >= 0.9, scheduler
    # a bfloat16 model is served as it is, never quantized or widened on the way
    assert Q.prepare(served, None) is served and Q.prepare(served, "bf16") is served
    with pytest.raises(UsageError, match="stored with bf16 weights"):
        Q.prepare(served, "fp32")
    with pytest.raises(UsageError, match="--lora merged needs quantized weights"):
        Q.prepare(copy.deepcopy(model), "bf16", lora="merged")


def test_rotary_frequencies_stay_float32_and_exact_under_any_cast():
    """A cast of the whole model (to_bf16, load_model's dtype, .half()) leaves the rotary frequencies float32
    and equal to freshly computed ones (rounded to bf16 and widened back they would keep the rounding)."""
    model = _relaxed()
    want = [b.clone() for b in model.model.rotary.buffers()]
    assert want and all(b.dtype == torch.float32 for b in want)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.float(), lambda m: m.half(), lambda m: m.to("cpu")):
        cast(model)
        got = list(model.model.rotary.buffers())
        assert all(g.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want))
    assert next(model.model.embed_tokens.parameters()).dtype == torch.float16  # the cast reached the rest


def test_a_float_checkpoint_read_in_bf16_is_the_cast_model_without_a_float32_copy(tmp_path, monkeypatch):
    """load_model(..., dtype=bfloat16), as `serve|generate --weights bf16` read a float checkpoint: every
    floating tensor cast as it is read (no float32 copy of the model held), the rotary frequencies float32,
    the tied head still the embedding, and the same logits as the float32 model cast afterwards (to_bf16)."""
    from test_train_fixtures import byte_tokenizer

    from looplm.models import load_model, save_model

    _cpu_bf16(monkeypatch, True)
    model = _relaxed()
    save_model(model, byte_tokenizer("<a> <b>"), tmp_path / "m")
    direct, _ = load_model(tmp_path / "m", dtype=torch.bfloat16)
    cast = Q.to_bf16(load_model(tmp_path / "m")[0])
    assert {p.dtype for p in direct.parameters()} == {torch.bfloat16}
    assert all(b.dtype == torch.float32 for b in direct.model.rotary.buffers())
    assert not any(t.is_meta for t in [*direct.parameters(), *direct.buffers()])
    assert Q.stored_format(direct) == "bf16" and Q.prepare(direct, "bf16") is direct
    if direct.config.tie_word_embeddings:
        assert direct.lm_head.weight is direct.model.embed_tokens.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, cast(ids).logits)
