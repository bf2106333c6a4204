"""MKL-packed weights (models/packed.py): the same products as F.linear, used only where valid."""

import pytest
import torch
from conftest import small_relaxed as _relaxed

from looplm.models import packed as packing
from looplm.models.layers import LoopLinear

pytestmark = pytest.mark.skipif(not packing.mkl_packing_available(), reason="torch built without MKL")


@pytest.mark.parametrize("rows", [1, 2, 6, 33, 200])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    p = packing.PackedWeight(w)
    with torch.no_grad():
        y = packing.linear(x, w, b, p)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert y.shape == (rows, 96)
    assert torch.allclose(y.double(), ref, atol=1e-5)


def test_packed_model_gives_the_same_logits_and_falls_back_where_it_must():
    model = _relaxed()
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
        added = packing.pack_for_cpu(model)
        linears = [m for m in model.modules() if isinstance(m, LoopLinear)]
        assert added > 0 and all(m.packed is not None for m in linears) and model.head_packed is not None
        assert packing.pack_for_cpu(model) == added  # idempotent: valid copies are kept
        kept = linears[0].packed
        assert packing.pack_for_cpu(model) == added and linears[0].packed is kept
        out = model(ids).logits
        one = model.exit_logits(torch.randn(3, 64))  # the few-rows head path
    assert torch.allclose(out, ref, atol=1e-5)
    assert one.shape == (3, 256)

    # gradients on: the packed copy is never used (it is not differentiable)
    loss = model(ids).logits.sum()
    loss.backward()
    assert linears[0].weight.grad is not None

    # an in-place update (an optimizer step) makes the copy stale: F.linear runs, with the new weight
    with torch.no_grad():
        linears[0].weight.add_(1.0)
        assert not linears[0].packed.usable(torch.zeros(1, 64), linears[0].weight)
        moved = model(ids).logits
    assert not torch.allclose(moved, out, atol=1e-3)
    packing.unpack(model)
    assert all(m.packed is None for m in linears) and model.head_packed is None


def test_switch_off_sends_calls_through_f_linear():
    w, x = torch.randn(32, 16), torch.randn(4, 16)
    p = packing.PackedWeight(w)
    packing.enabled = False
    try:
        assert not p.usable(x, w)
    finally:
        packing.enabled = True
    with torch.no_grad():
        assert p.usable(x, w)
        assert not p.usable(x.double(), w)
        assert not p.usable(x, torch.randn(32, 16))  # another weight


def test_a_packed_model_copies_and_pickles_without_its_packed_copies():
    import copy
    import io

    model = _relaxed()
    packing.pack_for_cpu(model)
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].attn.q_proj.packed is None and twin.head_packed is None
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert back.model.layers[0].attn.q_proj.packed is None
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model(ids).logits, atol=1e-5)
