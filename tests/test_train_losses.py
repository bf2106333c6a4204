"""Objectives checked against direct formulas written out element by element."""

import math

import pytest
import torch

from looplm.train.losses import ce_loss, divergence, exit_weights, head_kd_loss, kd_loss, objective


def _probs(row, T=1.0):
    m = max(row)
    e = [math.exp((x - m) / T) for x in row]
    s = sum(e)
    return [x / s for x in e]


def _direct(p, q, func):
    if func == "fkl":
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    if func == "rkl":
        return sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
    if func == "jsd":
        m = [(pi + qi) / 2 for pi, qi in zip(p, q)]
        return 0.5 * sum(pi * math.log(pi / mi) for pi, mi in zip(p, m)) + 0.5 * sum(
            qi * math.log(qi / mi) for qi, mi in zip(q, m)
        )
    return 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))


@pytest.mark.parametrize("func", ["fkl", "rkl", "jsd", "tvd"])
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_divergences_match_direct_formulas(func, T):
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 7, generator=g) * 3, torch.randn(5, 7, generator=g) * 3
    got = divergence(s, t, func, T)
    for r in range(5):
        want = _direct(_probs(t[r].tolist(), T), _probs(s[r].tolist(), T), func)
        assert got[r].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert (got >= -1e-7).all()
    assert divergence(t, t, func, T).abs().max() < 1e-6  # zero for identical distributions


def test_ce_matches_direct_and_ignores_minus_100():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 6, generator=g)
    ids = torch.randint(0, 6, (2, 4), generator=g)
    want = []
    for b in range(2):
        for t in range(3):
            p = _probs(logits[b, t].tolist())
            want.append(-math.log(p[ids[b, t + 1]]))
    assert ce_loss(logits, ids).item() == pytest.approx(sum(want) / len(want), rel=1e-6)
    ids2 = ids.clone()
    ids2[0, 2] = -100  # the label of position (0, 1)
    keep = [w for i, w in enumerate(want) if i != 1]
    assert ce_loss(logits, ids2).item() == pytest.approx(sum(keep) / len(keep), rel=1e-6)


def test_kd_loss_is_mean_over_positions_times_T_squared():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(2, 5, 9, generator=g), torch.randn(2, 5, 9, generator=g)
    ids = torch.randint(0, 9, (2, 5), generator=g)
    T = 2.0
    rows = [
        _direct(_probs(t[b, i].tolist(), T), _probs(s[b, i].tolist(), T), "fkl") for b in range(2) for i in range(4)
    ]
    assert kd_loss(s, t, ids, "fkl", T).item() == pytest.approx(T * T * sum(rows) / len(rows), rel=1e-5)


def test_exit_weights():
    assert exit_weights(2, "weighted") == pytest.approx([1 / 3, 2 / 3])
    assert exit_weights(4, "weighted") == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert exit_weights(3, "aggressive", 0.3) == [0.3, 0.3, 1.0]
    assert exit_weights(3, "none") == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="weighted"):
        exit_weights(2, "bogus")
    with pytest.raises(ValueError, match="fkl"):
        divergence(torch.zeros(1, 2), torch.zeros(1, 2), "kl")


def test_objective_combines_parts_as_documented():
    g = torch.Generator().manual_seed(4)
    e1, e2, teacher = (torch.randn(2, 6, 11, generator=g) for _ in range(3))
    ids = torch.randint(0, 11, (2, 6), generator=g)
    c, w, T = 0.3, 0.4, 1.5
    loss, parts = objective(
        [e1, e2],
        ids,
        teacher,
        kd="rkl",
        kd_weight=w,
        temperature=T,
        early_exit="aggressive",
        exit_coef=c,
        self_distill=True,
        self_distill_weight=0.7,
    )
    want = (
        c * (ce_loss(e1, ids) + 0.7 * kd_loss(e1, e2, ids, "fkl", 1.0))
        + (1 - w) * ce_loss(e2, ids)
        + w * kd_loss(e2, teacher, ids, "rkl", T)
    )
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert set(parts) == {"ce_1", "ce_2", "kd", "sd_1", "loss"}
    # weighted without teacher: 1/3 CE_1 + 2/3 CE_2
    loss, _ = objective([e1, e2], ids, early_exit="weighted")
    assert loss.item() == pytest.approx((ce_loss(e1, ids) / 3 + 2 * ce_loss(e2, ids) / 3).item(), rel=1e-6)
    # none: the final exit only
    loss, parts = objective([e2], ids)
    assert loss.item() == pytest.approx(ce_loss(e2, ids).item()) and set(parts) == {"ce", "loss"}


def test_self_distillation_target_is_detached():
    g = torch.Generator().manual_seed(5)
    e1 = torch.randn(1, 5, 7, generator=g, requires_grad=True)
    e2 = torch.randn(1, 5, 7, generator=g, requires_grad=True)
    ids = torch.randint(0, 7, (1, 5), generator=g)
    loss, _ = objective([e1, e2], ids, early_exit="aggressive", exit_coef=0.1, self_distill=True)
    loss.backward()
    g2 = e2.grad.clone()
    e2.grad = None
    ce_loss(e2, ids).backward()  # the final exit's gradient is its own CE's, nothing from distillation
    assert torch.allclose(g2, e2.grad, atol=1e-7)


@pytest.mark.parametrize(
    "softcap, T, masked, compiled", [(None, 1.0, False, False), (30.0, 2.0, True, False), (30.0, 2.0, True, True)]
)
def test_head_kd_loss_matches_kd_loss_on_materialised_logits(softcap, T, masked, compiled):
    """The chunked head + forward-KL gives kd_loss's value and gradient on the logits it never stores whole
    (chunks of 5 rows over 2 x 9 - 2 positions, so the last chunk is partial), its chunk math eager or compiled."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 9, 6, generator=g, requires_grad=True)
    zt = torch.randn(2, 9, 6, generator=g)
    w, wt = torch.randn(11, 6, generator=g) * 2, torch.randn(11, 6, generator=g) * 2
    ids = torch.randint(0, 11, (2, 9), generator=g)
    if masked:
        ids[0, 3:6] = -100

    def head(x, weight):
        x = x @ weight.t()
        return torch.tanh(x / softcap) * softcap if softcap else x

    want = kd_loss(head(z, w), head(zt, wt), ids if masked else None, "fkl", T)
    (want_grad,) = torch.autograd.grad(want, z)
    got = head_kd_loss(
        z, w, zt, wt, ids if masked else None, softcap=softcap, temperature=T, chunk_rows=5, compiled=compiled
    )
    (got_grad,) = torch.autograd.grad(got * 3.0, z)  # an outer factor reaches the gradient
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    torch.testing.assert_close(got_grad, want_grad * 3.0, rtol=1e-4, atol=1e-6)


def test_head_kd_loss_under_autocast_and_frozen_heads_only():
    z = torch.randn(1, 4, 6, requires_grad=True)
    w = torch.randn(11, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        zb = z.to(torch.bfloat16)
        loss = head_kd_loss(zb, w, zb.detach(), w)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(0.0, abs=1e-6)  # float32 softmax math
    loss.backward()
    assert z.grad is not None and z.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="frozen head"):
        head_kd_loss(z, w.requires_grad_(), z.detach(), w.detach())


def test_head_kd_loss_under_autocast_keeps_its_logits_float32():
    """Under bf16 autocast only the gradient's head product is bf16. Logits of a trained model's size (top ones
    near 20, where bf16's step is 0.125) rounded to bf16 would move the gradient of a student close to its
    teacher by several percent (6% on a real healing batch); kept float32 it moves by the
    gradient product's own rounding."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 64, 32, generator=g)
    w = torch.randn(500, 32, generator=g) * 2.0  # logits with a spread of ~11, top ones ~30
    zt = z + 0.05 * torch.randn(z.shape, generator=g)  # the student close to its teacher

    def grad(autocast: torch.dtype | None) -> torch.Tensor:
        x = z.clone().requires_grad_()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            head_kd_loss(x, w, zt, w).backward()
        return x.grad

    exact, mixed = grad(None), grad(torch.bfloat16)
    assert ((mixed - exact).norm() / exact.norm()).item() < 0.01
    # float16's range would flush the 1/rows-scaled gradient: its product stays float32 there
    torch.testing.assert_close(grad(torch.float16), exact)


def test_hidden_errors_weigh_channels_as_the_original_norms_read_them():
    """The hidden-state errors' channel weights (healing's): an error in a channel the norms scale to 0 costs
    nothing, one in a channel they keep costs as before; the weights are the root mean square of the readers'
    effective scales (Gemma's norms scale by 1 + w)."""
    from looplm.models import LoopLMConfig, LoopLMForCausalLM
    from looplm.train.losses import read_weights, relative_error

    target = torch.tensor([[[3.0, 4.0, 0.0]]])
    off_first = target + torch.tensor([1.0, 0.0, 0.0])
    assert relative_error(off_first, target).item() == pytest.approx(1 / 25)
    assert relative_error(off_first, target, torch.tensor([0.0, 1.0, 1.0])).item() == 0.0
    assert relative_error(off_first, target, torch.ones(3)).item() == pytest.approx(1 / 25)
    for norm_type, offset in (("rms", 0.0), ("rms_plus1", 1.0)):
        cfg = LoopLMConfig(
            vocab_size=16,
            hidden_size=4,
            intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=1,
            num_key_value_heads=1,
            norm_type=norm_type,
        )
        model = LoopLMForCausalLM(cfg)
        readers = [n for layer in model.model.layers for n in (layer.attn_norm, layer.mlp_norm)] + [model.model.norm]
        for i, n in enumerate(readers):
            n.weight.data.fill_(float(i + 1) - offset)  # effective scales 1, 2, 3, 4, 5
        expected = (sum((i + 1) ** 2 for i in range(5)) / 5) ** 0.5
        assert torch.allclose(read_weights(model), torch.full((4,), expected))
