"""Fused ``lm_head`` + KL(target || draft), row chunk by row chunk.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``D`` draft hidden size, ``V_d``
draft vocabulary. Local: ``n`` charged rows, ``m`` distinct target positions, ``z`` the
draft logits of a row, ``p`` its target distribution.

Why our own: the plain path (``lm_head`` -> ``log_softmax`` -> KL -> autograd) keeps
several ``[n, V_d]`` float tensors alive until backward, each as large as the draft's
logits over every charged element of the row. The loss is a sum over rows, so its
gradient with respect to the logits is known in the forward, ``sum(p) * softmax(z) - p``
per row. Each chunk therefore turns straight into ``grad_hidden = g @ W`` and
``grad_W += g.T @ hidden`` and is dropped: peak extra memory is three reused
``[chunk, V_d]`` buffers, and the backward is a scale by the incoming scalar gradient.

Per row, ``KL = sum p log p - p . z + sum(p) * lse(z)``: the first term is computed
once per distinct target position, so no ``[chunk, V_d]`` log-softmax is formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.settings import check_finite, fail, setting

# Rows per chunk: small enough that a chunk's [rows, V_d] float32 buffers stay in the last
# level cache across the chunk's elementwise passes, large enough that its matmuls stay
# efficient (``python -m eval.bench_train_step`` times the step).
CHUNK_ROWS = 512


@dataclass(frozen=True)
class LossConfig:
    """The ``loss`` section: what :func:`fused_linear_kl` adds to the plain KL."""

    hard_label_weight: float = setting(
        0.0,
        "Weight w of the target's argmax in the KL target, (1-w) p + w onehot(argmax p): "
        "greedy acceptance checks only the argmax. 0 = plain KL (speculators').",
    )
    tv_weight: float = setting(
        0.0,
        "Weight of a total-variation term, sum |p - q| / 2 per element, added to the loss: "
        "a sampled draft token is rejected at that rate. 0 = none.",
    )

    def __post_init__(self) -> None:
        w = self.hard_label_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1:
            fail("hard_label_weight", w, "a number in [0, 1]")
        check_finite("tv_weight", self.tv_weight, 0, strict=False)


def _lse(row_max: torch.Tensor, softmax: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` of rows from their max and softmax: ``max - log softmax[argmax]``.

    The softmax at the argmax is the row's largest probability (>= 1 / V), so its log is
    exact to rounding; this saves ``logsumexp``'s own exp pass over ``[rows, V]``.
    """
    return row_max - softmax.gather(-1, argmax.unsqueeze(-1)).squeeze(-1).log()


class _FusedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, target_p, target_stats, target_argmax, target_rows, with_grad,
        mm_dtype, tv_weight,
    ):
        dtype = target_p.dtype
        n, vocab = hidden.shape[0], weight.shape[0]
        kl = hidden.new_zeros(n, dtype=dtype)
        hits = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        need_h = with_grad and ctx.needs_input_grad[0]
        need_w = with_grad and ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        # The matmuls run in mm_dtype (lower under autocast); logits, softmax and the
        # logit gradient stay in the float32 `dtype`, gradients in their tensors' dtypes.
        w = weight.to(mm_dtype)
        exact = hidden.dtype == mm_dtype == dtype  # out= matmuls, no casts
        # Three [chunk, V_d] buffers reused by every chunk: a fresh tensor this size is
        # a fresh mmap, and its page faults cost as much as the arithmetic on it.
        rows_max = min(n, CHUNK_ROWS)
        z_buf = hidden.new_empty(rows_max, vocab, dtype=dtype)
        q_buf = torch.empty_like(z_buf)
        p_buf = target_p.new_empty(rows_max, vocab)
        for s in range(0, n, CHUNK_ROWS):
            h = hidden[s : s + CHUNK_ROWS].to(mm_dtype)
            rows = target_rows[s : s + CHUNK_ROWS]
            c = h.shape[0]
            z = z_buf[:c]  # draft logits [c, V_d]
            if exact:
                torch.mm(h, w.T, out=z)
            else:
                z.copy_(h @ w.T)
            p = torch.index_select(target_p, 0, rows, out=p_buf[:c])
            neg_entropy, p_sum = target_stats[rows].unbind(-1)
            z_max, z_argmax = z.max(-1)
            hits[s : s + CHUNK_ROWS] = z_argmax == target_argmax[rows]
            p_dot_z = torch.mul(p, z, out=q_buf[:c]).sum(-1)  # q_buf as scratch
            q = torch.softmax(z, -1, out=q_buf[:c])
            # KL = sum_v p (log p - z + lse) with lse(z) = z_max - log q[argmax]
            kl[s : s + CHUNK_ROWS] = neg_entropy - p_dot_z + p_sum * _lse(z_max, q, z_argmax)
            if tv_weight:
                # TV = sum |q - p| / 2; d TV / d z = q (sign - q . sign) / 2, sign = sign(q - p)
                sign = torch.sub(q, p).sign_()
                kl[s : s + CHUNK_ROWS] += tv_weight / 2 * (sign * (q - p)).sum(-1)
                g_tv = q * (sign - (sign * q).sum(-1, keepdim=True)) * (tv_weight / 2)
            if need_h or need_w:
                # d KL / d z = p_sum * softmax(z) - p
                g = q.mul_(p_sum.unsqueeze(-1)).sub_(p)
                if tv_weight:
                    g.add_(g_tv)
                g = g.to(mm_dtype)
                if need_h and exact:
                    torch.mm(g, w, out=grad_h[s : s + CHUNK_ROWS])
                elif need_h:
                    grad_h[s : s + CHUNK_ROWS] = g @ w
                if need_w and exact:
                    grad_w.addmm_(g.T, h)
                elif need_w:
                    grad_w += g.T @ h
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(hits)
        return kl.sum(), hits

    @staticmethod
    def backward(ctx, grad_loss, _grad_hits):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.to(grad_h.dtype if grad_h is not None else grad_w.dtype)
        return (
            None if grad_h is None else grad_h * scale,
            None if grad_w is None else grad_w * scale,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_linear_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
    hard_label_weight: float = 0.0,
    tv_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_i KL(p[target_rows[i]] || softmax(hidden[i] @ weight.T))``, ``p = softmax(target)``.

    Args:
        hidden: ``[n, D]`` rows entering the (bias-free) ``lm_head``.
        weight: ``[V_d, D]`` ``lm_head`` weight.
        target_logits: ``[m, V_d]`` target logits at the distinct positions (no grad).
        target_rows: ``[n]`` row of ``target_logits`` for each hidden row.
        hard_label_weight: ``w`` in [0, 1]; the target distribution becomes
            ``(1 - w) p + w onehot(argmax p)``. Its KL is ``(1 - w) KL(p || q) + w CE(argmax,
            q)`` up to a constant, so ``w`` moves the draft's capacity from the tail of ``p``
            to the one token greedy acceptance checks. 0: plain KL.
        tv_weight: ``t >= 0`` adds ``t * TV(p, q) = t / 2 * sum |p - q|`` per row, the
            distance that sets a sampled draft token's rejection rate (``1 - sum min(p,
            q)``); 0: none.

    Returns:
        ``(loss_sum, hits)``: the summed loss (scalar, grad to ``hidden`` and ``weight``)
        and ``[n]`` bool argmax agreement. Equals :func:`trainer._kl_div_loss` summed
        (``w = t = 0``).
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    device = hidden.device.type
    # Under autocast the lm_head matmuls take its dtype, as nn.Linear's would; all else
    # here runs with autocast off (it would lower the float32 row dot products too).
    autocast = torch.is_autocast_enabled(device)
    mm_dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
    with torch.no_grad(), torch.autocast(device, enabled=False):
        # Per distinct target row, once: p, sum p log p, sum p (1 up to rounding) and the
        # argmax, with log p = t - lse(t) so no [m, V_d] log-softmax is kept.
        target_p = torch.empty(target_logits.shape, dtype=dtype, device=target_logits.device)
        target_stats = target_p.new_empty(target_logits.shape[0], 2)
        target_argmax = torch.empty(
            target_logits.shape[0], dtype=torch.long, device=target_logits.device
        )
        for s in range(0, target_logits.shape[0], CHUNK_ROWS):
            t = target_logits[s : s + CHUNK_ROWS].to(dtype, copy=True)  # ours to overwrite
            t_max, t_argmax = t.max(-1)
            p = torch.softmax(t, -1, out=target_p[s : s + CHUNK_ROWS])
            if hard_label_weight:
                p.mul_(1 - hard_label_weight)
                hard = torch.full_like(t_max[:, None], hard_label_weight)
                p.scatter_add_(-1, t_argmax[:, None], hard)
            p_sum = p.sum(-1)
            if hard_label_weight:
                neg_entropy = torch.special.xlogy(p, p).sum(-1)
            else:
                neg_entropy = t.mul_(p).sum(-1) - _lse(t_max, p, t_argmax) * p_sum
            target_stats[s : s + CHUNK_ROWS, 0] = neg_entropy
            target_stats[s : s + CHUNK_ROWS, 1] = p_sum
            target_argmax[s : s + CHUNK_ROWS] = t_argmax
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        return _FusedLinearKL.apply(
            hidden, weight, target_p, target_stats, target_argmax, target_rows, with_grad, mm_dtype,
            tv_weight,
        )


def linear_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
    hard_label_weight: float = 0.0,
    tv_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_linear_kl`'s loss and hits as plain tensor operations, for a compiled
    region: the compiler fuses the softmaxes and the reductions over ``[n, V_d]``, and
    autograd gives the backward. Same arguments, same values up to rounding."""
    device = hidden.device.type
    autocast = torch.is_autocast_enabled(device)
    mm_dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.autocast(device, enabled=False):
        z = (hidden.to(mm_dtype) @ weight.to(mm_dtype).T).to(dtype)  # [n, V_d]
        with torch.no_grad():
            t = target_logits.to(dtype)
            t_argmax = t.argmax(-1)
            p = torch.softmax(t, -1)
            if hard_label_weight:
                onehot = torch.nn.functional.one_hot(t_argmax, p.shape[-1]).to(dtype)
                p = (1 - hard_label_weight) * p + hard_label_weight * onehot
            p = p[target_rows]
        log_q = torch.log_softmax(z, -1)
        kl = (torch.special.xlogy(p, p) - p * log_q).sum(-1)
        if tv_weight:
            kl = kl + tv_weight / 2 * (log_q.exp() - p).abs().sum(-1)
        hits = z.detach().argmax(-1) == t_argmax[target_rows]
    return kl.sum(), hits
