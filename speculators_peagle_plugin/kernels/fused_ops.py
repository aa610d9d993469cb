"""Fused RMSNorm and rotary embedding: transformers' formulas with hand-written backwards.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements, ``hd`` head dim.
Each function computes exactly what the transformers module it replaces computes; the
gain is fewer full-tensor passes and less saved for backward.
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class _RMSNormFunction(torch.autograd.Function):
    """``weight * x * rsqrt(mean(x**2, -1) + eps)`` with a hand-written backward.

    transformers' RMSNorm is five elementwise ops, each saving or re-reading a full
    tensor for autograd; this is the same formula (float32 in, float32 math) in three
    passes forward and five backward, saving ``x`` and the ``[..., 1]`` scale.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        width = x.shape[-1]
        r = torch.rsqrt(torch.einsum("...i,...i->...", x, x).div_(width).add_(eps)).unsqueeze(-1)
        ctx.save_for_backward(x, r, weight)
        return (x * r).mul_(weight)

    @staticmethod
    def backward(ctx, grad_y):
        x, r, weight = ctx.saved_tensors
        width = x.shape[-1]
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:  # sum over rows of grad_y * x * r
            grad_w = torch.mv((grad_y * x).reshape(-1, width).T, r.reshape(-1))
        if ctx.needs_input_grad[0]:
            # d/dx of w x r: r (u - x r**2 (u . x) / width), u = grad_y * w
            u = grad_y * weight
            c = torch.einsum("...i,...i->...", u, x).unsqueeze(-1).mul_(r.pow(3)).div_(width)
            grad_x = torch.addcmul(u.mul_(r), x, c, value=-1)
        return grad_x, grad_w, None


class _RotaryFunction(torch.autograd.Function):
    """transformers' ``x * cos + rotate_half(x) * sin`` in place-updated halves.

    Same arithmetic, no ``rotate_half`` copy; the backward needs only ``cos, sin``.
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        half = grad_out.shape[-1] // 2
        grad_x = grad_out * cos
        grad_x[..., :half].addcmul_(grad_out[..., half:], sin[..., half:])
        grad_x[..., half:].addcmul_(grad_out[..., :half], sin[..., :half], value=-1)
        return grad_x, None, None


def apply_rotary(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``: fused eagerly, transformers'
    own ops inside a compiled region (its compiler fuses them; see ``_rms_norm`` of
    :mod:`..model.peagle_draft` for why no hand-written backward is traced).

    Args:
        q: ``[1, nh, N, hd]``; k: ``[1, nkv, N, hd]``; cos, sin: ``[1, N, hd]``.
    """
    if torch.compiler.is_compiling():
        return apply_rotary_pos_emb(q, k, cos, sin)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _RotaryFunction.apply(q, cos, sin), _RotaryFunction.apply(k, cos, sin)
