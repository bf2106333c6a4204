"""The shared AdamW: fused where the device has the kernel, the same update as PyTorch's default; the weight
average (`looplm heal --e2e-average`)."""

import pytest
import torch

from looplm.train.optim import WeightAverage, adamw


def test_adamw_is_fused_on_cpu_and_updates_as_the_default():
    g = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    start = [p.detach().clone() for p in a]
    fused = adamw([{"params": a[:1], "weight_decay": 0.1}, {"params": a[1:], "weight_decay": 0.0}], lr=1e-2)
    plain = torch.optim.AdamW([{"params": b[:1], "weight_decay": 0.1}, {"params": b[1:], "weight_decay": 0.0}], lr=1e-2)
    assert fused.defaults["fused"] and not plain.defaults.get("fused")
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for opt, ps in ((fused, a), (plain, b)):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
            opt.step()
    for p, q, p0 in zip(a, b, start):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert (p - p0).abs().min() > 1e-3  # every entry moved: three steps of lr 1e-2


def test_adamw_falls_back_where_no_fused_kernel_applies():
    meta = torch.nn.Parameter(torch.randn(3, device="meta"))
    assert not adamw([meta], lr=1e-3).defaults["fused"]


def test_weight_average_is_a_warmed_up_moving_average_that_swaps_in_and_restores():
    """WeightAverage: avg <- d avg + (1 - d) p after each step, with d = min(decay, (1 + n) / (10 + n)); an
    evaluation block sees the average and the weights come back after it; copy_in keeps it; the state dict
    restores it into a fresh average of the same parameters."""
    p = torch.nn.Parameter(torch.zeros(3))
    avg = WeightAverage([p], decay=0.5)
    expected = torch.zeros(3)
    for n, value in enumerate((1.0, 2.0, 4.0), start=1):
        with torch.no_grad():
            p.fill_(value)
        avg.update()
        d = min(0.5, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * value
    assert torch.allclose(avg.average[0], expected)
    with avg.swapped_in():
        assert torch.allclose(p.detach(), expected)
    assert torch.equal(p.detach(), torch.full((3,), 4.0))
    restored = WeightAverage([p], decay=0.9)
    restored.load_state_dict(avg.state_dict())
    assert restored.updates == 3 and restored.decay == 0.5 and torch.equal(restored.average[0], avg.average[0])
    avg.copy_in()
    assert torch.allclose(p.detach(), expected)
    with pytest.raises(ValueError, match="decay"):
        WeightAverage([p], decay=1.0)
