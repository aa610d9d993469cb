"""Fused ``lm_head`` + KL(target || draft), row chunk by row chunk.

Legend: ``n`` = charged rows, ``m`` = distinct target positions, ``H`` = draft
hidden size, ``V_d`` = draft vocabulary.

Why our own: the plain path (``lm_head`` -> ``log_softmax`` -> KL -> autograd) keeps
several ``[n, V_d]`` float tensors alive until backward; at 8K tokens and K = 8
that is ~1 GB each. The loss is a sum over rows, so its gradient with respect to
the logits is known in the forward, ``softmax(z) - p_target`` per row (the KL's
``d/dz`` when ``p_target`` sums to one). Each chunk therefore turns straight into
``grad_hidden = g @ W`` and ``grad_W += g.T @ hidden`` and is dropped: peak extra
memory is one ``[chunk, V_d]`` block, and the backward is a scale by the
incoming scalar gradient.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 1024


class _FusedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_logp, target_argmax, target_rows, with_grad):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        kl = hidden.new_zeros(n, dtype=dtype)
        hits = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        need_h = with_grad and ctx.needs_input_grad[0]
        need_w = with_grad and ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        for s in range(0, n, CHUNK_ROWS):
            h = hidden[s : s + CHUNK_ROWS]
            rows = target_rows[s : s + CHUNK_ROWS]
            log_q = torch.log_softmax((h @ weight.T).to(dtype), dim=-1)  # [c, V_d]
            logp = target_logp[rows]
            p = logp.exp()
            kl[s : s + CHUNK_ROWS] = (p * (logp - log_q)).sum(-1)
            hits[s : s + CHUNK_ROWS] = log_q.argmax(-1) == target_argmax[rows]
            if need_h or need_w:
                g = log_q.exp_().sub_(p).to(hidden.dtype)  # d KL / d logits
                if need_h:
                    grad_h[s : s + CHUNK_ROWS] = g @ weight
                if need_w:
                    grad_w.addmm_(g.T, h)
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
        )


def fused_linear_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_i KL(softmax(target[target_rows[i]]) || softmax(hidden[i] @ weight.T))``.

    Args:
        hidden: ``[n, H]`` rows entering the (bias-free) ``lm_head``.
        weight: ``[V_d, H]`` ``lm_head`` weight.
        target_logits: ``[m, V_d]`` target logits at the distinct positions (no grad).
        target_rows: ``[n]`` row of ``target_logits`` for each hidden row.

    Returns:
        ``(kl_sum, hits)``: the summed KL (scalar, grad to ``hidden`` and ``weight``)
        and ``[n]`` bool argmax agreement. Equals :func:`trainer._kl_div_loss` summed.
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.no_grad():
        target_logp = torch.log_softmax(target_logits.to(dtype), dim=-1)
        target_argmax = target_logp.argmax(-1)
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearKL.apply(hidden, weight, target_logp, target_argmax, target_rows, with_grad)
