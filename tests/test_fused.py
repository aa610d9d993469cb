"""The fused kernels against float64 oracles: lm_head + KL (hard labels, a TV term,
autocast), RMSNorm and rotary against transformers' own forward and autograd."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from speculators_peagle_plugin.kernels.fused_kl import fused_linear_kl
from speculators_peagle_plugin.kernels.fused_ops import apply_rotary
from speculators_peagle_plugin.model.peagle_draft import _rms_norm
from speculators_peagle_plugin.training.peagle_trainer import _kl_div_loss


@pytest.mark.parametrize("weight_grad", [True, False])
def test_fused_linear_kl_matches_plain_kl_and_autograd(monkeypatch, weight_grad):
    from speculators_peagle_plugin.kernels import fused_kl as loss

    monkeypatch.setattr(loss, "CHUNK_ROWS", 7)  # several chunks and a ragged tail
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=weight_grad)
    targets = torch.randn(5, 11, generator=gen, dtype=torch.float64)
    rows = torch.randint(0, 5, (23,), generator=gen)
    kl_sum, hits = fused_linear_kl(hidden, weight, targets, rows)
    (kl_sum * 0.37).backward()
    got = [hidden.grad.clone(), None if not weight_grad else weight.grad.clone()]
    hidden.grad = None
    weight.grad = None
    logits = hidden @ weight.T
    want = _kl_div_loss(logits, targets[rows]).sum()
    (want * 0.37).backward()
    torch.testing.assert_close(kl_sum, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-10, atol=1e-14)
    if weight_grad:
        torch.testing.assert_close(got[1], weight.grad, rtol=1e-10, atol=1e-14)
    assert torch.equal(hits, logits.argmax(-1) == targets[rows].argmax(-1))


@pytest.mark.parametrize(("seed", "w"), [(0, 0.3), (1, 0.9), (2, 1.0)])
def test_fused_linear_kl_with_hard_labels_is_the_kl_to_the_mixed_target(monkeypatch, seed, w):
    """Oracle: KL((1-w) p + w onehot(argmax p) || q) in float64 through autograd, which is
    (1-w) KL(p || q) + w CE(argmax p, q) up to a constant of the target alone."""
    from speculators_peagle_plugin.kernels import fused_kl as loss

    monkeypatch.setattr(loss, "CHUNK_ROWS", 5)
    gen = torch.Generator().manual_seed(seed)
    n, m, vocab = int(torch.randint(9, 31, (1,), generator=gen)), 6, 13
    hidden = torch.randn(n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randn(m, vocab, generator=gen, dtype=torch.float64) * 2
    rows = torch.randint(0, m, (n,), generator=gen)
    kl_sum, hits = fused_linear_kl(hidden, weight, targets, rows, w)
    kl_sum.backward()
    got_h, got_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    p = torch.softmax(targets, -1)
    mixed = (1 - w) * p + w * torch.nn.functional.one_hot(p.argmax(-1), vocab).double()
    log_q = torch.log_softmax(hidden @ weight.T, -1)
    want = (torch.special.xlogy(mixed[rows], mixed[rows]) - mixed[rows] * log_q).sum()
    want.backward()
    torch.testing.assert_close(kl_sum, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, hidden.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got_w, weight.grad, rtol=1e-10, atol=1e-13)
    ce = -log_q.gather(-1, p.argmax(-1)[rows, None]).sum()
    plain = fused_linear_kl(hidden.detach(), weight.detach(), targets, rows)[0]
    entropy_gap = torch.special.xlogy(mixed, mixed) - (1 - w) * torch.special.xlogy(p, p)
    torch.testing.assert_close(
        kl_sum - (1 - w) * plain - w * ce, entropy_gap.sum(-1)[rows].sum(), rtol=1e-9, atol=1e-9
    )
    assert torch.equal(hits, (hidden @ weight.T).argmax(-1) == targets[rows].argmax(-1))


@pytest.mark.parametrize(("seed", "t", "w"), [(0, 0.5, 0.0), (1, 2.0, 0.0), (2, 1.0, 0.4)])
def test_fused_linear_kl_with_a_tv_term_matches_its_float64_oracle(monkeypatch, seed, t, w):
    """Oracle: sum KL(p || q) + t * sum |p - q| / 2 through autograd in float64 (``p`` the
    hard-label-mixed target where ``w > 0``)."""
    from speculators_peagle_plugin.kernels import fused_kl as loss

    monkeypatch.setattr(loss, "CHUNK_ROWS", 4)
    gen = torch.Generator().manual_seed(seed)
    n, vocab = int(torch.randint(7, 25, (1,), generator=gen)), 11
    hidden = torch.randn(n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randn(5, vocab, generator=gen, dtype=torch.float64) * 2
    rows = torch.randint(0, 5, (n,), generator=gen)
    got, _ = fused_linear_kl(hidden, weight, targets, rows, w, t)
    got.backward()
    got_h, got_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    p = torch.softmax(targets, -1)
    p = (1 - w) * p + w * torch.nn.functional.one_hot(p.argmax(-1), vocab).double()
    p = p[rows]
    log_q = torch.log_softmax(hidden @ weight.T, -1)
    want = (torch.special.xlogy(p, p) - p * log_q).sum() + t / 2 * (log_q.exp() - p).abs().sum()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, hidden.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got_w, weight.grad, rtol=1e-10, atol=1e-13)
    plain = fused_linear_kl(hidden.detach(), weight.detach(), targets, rows, w)[0]
    assert float(got - plain) > 1e-3  # the term is there


def test_fused_linear_kl_under_autocast_runs_its_matmuls_in_bfloat16():
    """Mixed precision: the lm_head products in bfloat16 (as nn.Linear's under autocast),
    the softmax / KL in float32, float32 gradients; oracle: float64 on the same roundings."""
    from speculators_peagle_plugin.kernels import fused_kl as loss

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 64, generator=gen, requires_grad=True)
    weight = (torch.randn(50, 64, generator=gen) / 4).requires_grad_()
    targets = torch.randn(6, 50, generator=gen) * 3
    rows = torch.randint(0, 6, (30,), generator=gen)

    def bf16(t):  # a bfloat16 rounding, carried on in float64
        return t.bfloat16().double()

    hb, wb = bf16(hidden.detach()), bf16(weight.detach())
    z = bf16(hb @ wb.T).requires_grad_()  # the bfloat16 logits, as the matmul returns them
    want = _kl_div_loss(z, targets.double()[rows]).sum()
    (g,) = torch.autograd.grad(want, z)
    want_grad_h, want_grad_w = bf16(bf16(g) @ wb), bf16(g).T @ hb
    with torch.no_grad():
        plain = fused_linear_kl(hidden, weight, targets, rows)[0]  # float32 matmuls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kl_sum, _ = fused_linear_kl(hidden, weight, targets, rows)
    kl_sum.backward()
    assert kl_sum.dtype == hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(kl_sum.double(), want, rtol=2e-5, atol=0)
    assert abs(float(plain) - want.item()) > 1e-4 * want.item()  # the check can tell
    torch.testing.assert_close(hidden.grad.double(), want_grad_h, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), want_grad_w, rtol=2e-2, atol=1e-4)
    assert loss.CHUNK_ROWS >= 30  # one chunk: the weight gradient is one rounded product


def test_under_autocast_fused_norm_stays_float32_bit_for_bit():
    """Autocast would lower the norm's products; the fused norm opts out."""
    gen = torch.Generator().manual_seed(6)
    norm = LlamaRMSNorm(64)
    x = torch.randn(3, 50, 64, generator=gen, requires_grad=True)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            y = _rms_norm(norm, x)
        results.append((y, *torch.autograd.grad((y * y).sum(), (x, norm.weight))))
    for a, b in zip(*results, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


# ------------------------------------------------------ fused norm and rotary helpers


@pytest.mark.parametrize("norm_cls", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("seed", range(2))
def test_fused_rms_norm_matches_transformers_forward_and_grads(norm_cls, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = norm_cls(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
    x = torch.randn(2, 37, 48, generator=gen, requires_grad=True)
    grad_y = torch.randn(2, 37, 48, generator=gen)
    got = _rms_norm(norm, x)
    got_grads = torch.autograd.grad(got, (x, norm.weight), grad_y)
    want = norm(x)  # transformers' own forward, float32
    want_grads = torch.autograd.grad(want, (x, norm.weight), grad_y)
    assert got.grad_fn is not None and "RMSNorm" in type(got.grad_fn).__name__
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the same formula in float64, against autograd through the plain expression
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    fused = type(got.grad_fn)._forward_cls.apply(x64, w64, 1e-5)
    plain = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    grads = [torch.autograd.grad(y, (x64, w64), grad_y.double()) for y in (fused, plain)]
    torch.testing.assert_close(fused, plain, rtol=1e-13, atol=1e-14)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_rotary_matches_transformers_forward_and_grads(dtype):
    gen = torch.Generator().manual_seed(3)
    # the attention module's layouts: heads-strided q, k; [1, N, D] cos / sin
    q = torch.randn(1, 29, 4, 16, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 29, 2, 16, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    angle = torch.rand(1, 29, 8, generator=gen, dtype=dtype) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    grads = [torch.randn(t.shape, generator=gen, dtype=dtype) for t in (q, k)]
    got = apply_rotary(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else {}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    got_grads = torch.autograd.grad(got, (q, k), grads)
    want_grads = torch.autograd.grad(want, (q, k), grads)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)
