"""The shared AdamW: fused where the device has the kernel, the same update as PyTorch's default."""

import torch

from looplm.train.optim import adamw


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
