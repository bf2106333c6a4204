"""The CPU product ways (models/cpu_products.py): the same products as F.linear, chosen by measuring, used only
where valid."""

import pytest
import torch
from conftest import small_relaxed as _relaxed

from looplm.models import cpu_products as cp
from looplm.models.layers import LoopLinear

FORMS = [f for f in cp.FORMS if f != "packed" or cp.mkl_packing_available()]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 2, 6, 33, 200])
def test_every_way_equals_f_linear(form, rows):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    cpu = cp.CpuWeight(w, cp.CpuPlan.uniform(form))
    assert (cpu.packed is not None) == (form == "packed")
    with torch.no_grad():
        y = cp.linear(x, w, b, cpu)
        y3 = cp.linear(x.reshape(1, rows, 64), w, b, cpu)  # a [1, N, hidden] step batch
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert y.shape == (rows, 96) and y3.shape == (1, rows, 96)
    assert torch.allclose(y.double(), ref, atol=1e-5) and torch.equal(y3[0], y)


def test_a_plan_follows_the_smallest_bucket_that_holds_the_rows():
    plan = cp.CpuPlan(
        {1: "transposed", 2: "transposed", 4: "packed", 8: "linear", 16: "linear", 32: "linear", 64: "linear"}
    )
    assert [plan.form(n) for n in (1, 2, 3, 4, 5, 64, 65, 512)] == [
        "transposed", "transposed", "packed", "packed", "linear", "linear", "linear", "linear"
    ]  # fmt: skip
    assert plan.needs_packing and plan.summary() == "1-2 rows transposed, 3-4 rows packed, 5-64 rows linear"
    with pytest.raises(ValueError, match="row counts"):
        cp.CpuPlan({1: "linear"})
    with pytest.raises(ValueError, match="one of"):
        cp.CpuPlan({b: "fast" for b in cp.BUCKETS})


def test_measuring_times_every_way_at_every_bucket_and_keeps_the_fastest():
    weights = [torch.randn(48, 32) for _ in range(3)]
    plan = cp.measure_plan(weights, rounds=1)
    assert set(plan.seconds) == set(cp.BUCKETS)
    for b in cp.BUCKETS:
        assert set(plan.seconds[b]) == set(FORMS) and all(s > 0 for s in plan.seconds[b].values())
        assert plan.forms[b] == min(plan.seconds[b], key=plan.seconds[b].get)
    assert cp.measure_plan([torch.randn(48, 32) for _ in range(3)]) is plan  # once per process per shapes


def test_measuring_leaves_the_global_random_state_alone():
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    cp.measure_plan([torch.randn(40, 24, generator=torch.Generator().manual_seed(1))], rounds=1)
    assert torch.equal(torch.rand(3), want)


def test_a_prepared_model_gives_the_same_logits_and_falls_back_where_it_must():
    model = _relaxed()
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
        plan, added = cp.prepare_for_cpu(model)
        linears = [m for m in model.modules() if isinstance(m, LoopLinear)]
        assert plan is not None and all(m.cpu_weight.plan is plan for m in linears)
        assert model.head_cpu_weight is not None
        assert added == sum(m.cpu_weight.nbytes for m in linears) + model.head_cpu_weight.nbytes
        kept = linears[0].cpu_weight
        assert cp.prepare_for_cpu(model) == (plan, added) and linears[0].cpu_weight is kept  # valid copies kept
        out = model(ids).logits
        few = model.exit_logits(torch.randn(3, 64))  # the few-rows head path
        one = model.exit_logits(torch.randn(1, 64))
    assert torch.allclose(out, ref, atol=1e-5)
    assert few.shape == (3, 256) and one.shape == (1, 256)

    # gradients on: the CPU ways are never used
    loss = model(ids).logits.sum()
    loss.backward()
    assert linears[0].weight.grad is not None

    # an in-place update (an optimizer step) makes the copy stale: F.linear runs, with the new weight
    with torch.no_grad():
        linears[0].weight.add_(1.0)
        assert not linears[0].cpu_weight.usable(torch.zeros(1, 64), linears[0].weight)
        moved = model(ids).logits
    assert not torch.allclose(moved, out, atol=1e-3)
    cp.release(model)
    assert all(m.cpu_weight is None for m in linears) and model.head_cpu_weight is None


def test_switch_off_sends_calls_through_f_linear():
    w, x = torch.randn(32, 16), torch.randn(4, 16)
    cpu = cp.CpuWeight(w, cp.CpuPlan.uniform("transposed"))
    cp.enabled = False
    try:
        assert not cpu.usable(x, w)
    finally:
        cp.enabled = True
    with torch.no_grad():
        assert cpu.usable(x, w)
        assert not cpu.usable(x.double(), w)
        assert not cpu.usable(x, torch.randn(32, 16))  # another weight


@pytest.mark.skipif(not cp.mkl_packing_available(), reason="torch built without MKL")
def test_a_prepared_model_copies_and_pickles_without_its_cpu_copies():
    import copy
    import io

    model = _relaxed()
    for m in model.modules():
        if isinstance(m, LoopLinear):
            m.cpu_weight = cp.CpuWeight(m.weight, cp.CpuPlan.uniform("packed"))
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].attn.q_proj.cpu_weight is None
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.model.layers[0].attn.q_proj.cpu_weight is None
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model(ids).logits, atol=1e-5)
