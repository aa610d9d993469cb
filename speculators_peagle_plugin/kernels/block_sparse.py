"""Exact P-EAGLE attention on CPU: block-sparse flash over the depth-0 band + the rollout.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements of the flat
sequence, ``nh`` / ``nkv`` query / key-value heads, ``g = nh / nkv``, ``hd`` head dim,
``K`` depths, ``W`` sliding window. Local: ``C`` rows of a query chunk, ``R`` depth-0
keys of its band, ``r`` rollout keys per row (``r <= K - 1``).

Why a CPU path of our own: torch's ``flex_attention`` has no backward on CPU (and
Inductor's CPU flex backward fails), and SDPA over a dense ``N x N`` mask computes
every score whatever the mask allows. The P-EAGLE mask is structured: a query
``(a, d)`` sees a contiguous band of depth-0 context ending at its own anchor
(:func:`~speculators_peagle_plugin.core.peagle_attention.visible_depth0_anchors`)
plus at most ``K - 1`` elements of its own rollout. So the keys of every query split
in two:

- the band, for a chunk of queries whose anchors share a ``CHUNK_ANCHORS`` span,
  is one contiguous run of depth-0 elements: the CPU flash kernel runs on a view
  of it (no gather; GQA as a batch dimension, no key copy) under the band mask;
- the rollout keys are gathered per row (``r <= K - 1`` of them) and scored by a
  small dense product;

and the two partial softmaxes are merged exactly through their log-sum-exps. The
result is the dense masked attention, computed on about ``N * min(W, L)`` scores
instead of ``N**2`` (:class:`_BlockSparseAttention`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.peagle_attention import same_rollout, visible_depth0_anchors

CHUNK_ANCHORS = 128


class _Chunk(NamedTuple):
    """One query chunk: the elements of all depths whose anchors share a span, and their keys.

    Args:
        rows: ``[C]`` query elements (anchor-major: each anchor's depths together).
        k0, k1: depth-0 key elements ``[k0, k1)`` (``R`` of them) holding every row's band.
        lo, hi: ``[C]`` each row sees band columns ``[lo, hi)`` (relative to ``k0``).
        chain: ``[C, r]`` element index of the row's own rollout element at depths
            ``1..r`` (``r`` = the chunk's deepest depth), or ``None`` if every row is depth 0.
        chain_ok: ``[C, r]`` bool: that rollout element exists and is visible (depth
            ``<=`` the row's); ``chain`` holds a harmless index where it is False.
        no_band: ``[C]`` bool rows whose band is empty, or ``None`` if none is.
    """

    rows: torch.Tensor
    k0: int
    k1: int
    lo: torch.Tensor
    hi: torch.Tensor
    chain: torch.Tensor | None
    chain_ok: torch.Tensor | None
    no_band: torch.Tensor | None


def _plan_chunks(
    anchor: torch.Tensor,
    depth: torch.Tensor,
    doc: torch.Tensor,
    sliding_window: int | None,
) -> list[_Chunk]:
    """Split the queries into chunks of ``CHUNK_ANCHORS`` consecutive anchors, all depths.

    Args:
        anchor, depth: ``[N]`` elements, depth-major, ascending anchor per depth.
        doc: ``[L]`` document per position, -1 padding.
        sliding_window: ``W`` of the context term, or ``None``.

    A query sees the depth-0 anchors :func:`visible_depth0_anchors` gives (its band)
    plus its rollout elements at depths ``1..d`` (:func:`same_rollout`). Depth-0
    anchors ascend, so the band is a contiguous run of depth-0 elements and a chunk's
    bands lie in one run ``[k0, k1)``. Taking every depth of a span together gives the
    flash kernel more rows per call (larger, faster blocks) over nearly the same keys
    a depth-0 chunk needs.
    """
    n = anchor.shape[0]
    if n == 0:
        return []
    n_depths = int(depth.max()) + 1
    starts = torch.searchsorted(depth, torch.arange(n_depths + 1, device=depth.device)).tolist()
    anchor0 = anchor[starts[0] : starts[1]]
    first, last = visible_depth0_anchors(anchor, depth, doc, sliding_window)
    lo = torch.searchsorted(anchor0, first)  # [N] first visible depth-0 element
    hi = torch.searchsorted(anchor0, last, right=True)  # [N] one past the last
    own = torch.arange(n, device=anchor.device)
    chain_cols, chain_oks = [], []
    for j in range(1, n_depths):  # each element's rollout element at depth j, by anchor
        blk = anchor[starts[j] : starts[j + 1]]
        at = torch.searchsorted(blk, anchor).clamp(max=blk.shape[0] - 1)
        ok = same_rollout(anchor, blk[at], depth, j)
        chain_oks.append(ok)
        chain_cols.append(torch.where(ok, starts[j] + at, own))
    if chain_oks:
        chain, chain_ok = torch.stack(chain_cols, 1), torch.stack(chain_oks, 1)  # [N, K - 1]
    has_band = hi > lo
    # Every other row sees at least itself (depth 0: its band ends at its own anchor;
    # deeper: its own rollout); padding rows see nothing and stay out (output 0).
    live = doc[anchor] >= 0
    order = torch.argsort(anchor * n_depths + depth)  # anchor-major
    span = anchor[order] // CHUNK_ANCHORS
    live_o = live[order]
    cut = (span[1:] != span[:-1]) | (live_o[1:] != live_o[:-1])
    edges = [0, *(torch.nonzero(cut).squeeze(1) + 1).tolist(), n]
    chunks = []
    for e0, e1 in zip(edges[:-1], edges[1:], strict=False):
        if not bool(live_o[e0]):
            continue
        rows = order[e0:e1]
        r_lo, r_hi = lo[rows], hi[rows]
        k0 = int(r_lo.min())
        k1 = max(int(r_hi.max()), k0)
        deepest = int(depth[rows].max())
        band = has_band[rows]
        chunks.append(
            _Chunk(
                rows,
                k0,
                k1,
                r_lo - k0,
                r_hi - k0,
                chain[rows, :deepest] if deepest else None,
                chain_ok[rows, :deepest] if deepest else None,
                None if bool(band.all()) else ~band,
            )
        )
    return chunks


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[1, nh, C, ...] -> [g, nkv, C, ...]`` view, ``g = nh // nkv``: GQA as a batch dimension.

    Query head ``j * g + i`` reads key head ``j`` (``repeat_interleave`` order), so batch
    ``i``, head ``j`` of the view pairs with key head ``j`` of a batch-expanded ``k``;
    no key or value copy is made.
    """
    return x.unflatten(1, (kv_heads, -1))[0].transpose(0, 1)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[g, nkv, C, ...] -> [1, nh, C, ...]``."""
    return x.transpose(0, 1).flatten(0, 1)[None]


def _band_mask(chunk: _Chunk, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[C, R]`` mask: 0 on each row's band columns ``[lo, hi)``, -inf elsewhere."""
    cols = torch.arange(chunk.k1 - chunk.k0, device=chunk.lo.device)
    seen = (cols >= chunk.lo[:, None]) & (cols < chunk.hi[:, None])
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(
        ~seen, float("-inf")
    )


def _cpu_flash(t: torch.Tensor) -> bool:
    """Whether the band runs on the CPU flash kernel (CPU tensors) or on plain matmuls."""
    return t.device.type == "cpu"


def _band_forward(qs, ks, vs, mask, scale):
    """Masked attention over one band: ``(out [g, nkv, C, hd], lse [g, nkv, C])``.

    CPU: the flash kernel (``O(C)`` memory, fused exp). Elsewhere (``chunked`` forced
    on CUDA): plain matmuls in the inputs' dtype, the softmax statistics in float32 (as
    a flash kernel keeps them) over ``[g, nkv, C, R]`` scores.
    """
    if _cpu_flash(qs):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qs, ks, vs, attn_mask=mask, scale=scale
        )
    scores = _band_scores(qs, ks, mask, scale)
    lse = torch.logsumexp(scores, -1)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)  # fully masked rows: weights 0
    return torch.exp(scores - safe.unsqueeze(-1)).to(vs.dtype) @ vs, lse


def _band_scores(qs, ks, mask, scale):
    """Scaled, masked scores of a band, in at least float32."""
    stats = torch.promote_types(qs.dtype, torch.float32)
    return (qs @ ks.transpose(-1, -2)).to(stats).mul_(scale).add_(mask)


def _band_backward(go, qs, ks, vs, os, ls, mask, scale):
    """Gradients ``(dq, dk, dv)`` of one band, given the MERGED output and log-sum-exp.

    With the merged ``os, ls`` the band's softmax weights are its share of the full
    softmax, and ``rowsum(dO * O)`` is the full one: the band's exact gradients.
    """
    if _cpu_flash(qs):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, qs, ks, vs, os, ls, 0.0, False, attn_mask=mask, scale=scale
        )
    p = torch.exp(_band_scores(qs, ks, mask, scale) - ls.unsqueeze(-1))
    delta = (go * os).to(p.dtype).sum(-1, keepdim=True)
    ds = (p * ((go @ vs.transpose(-1, -2)).to(p.dtype) - delta) * scale).to(qs.dtype)
    p = p.to(go.dtype)
    return ds @ ks, ds.transpose(-1, -2) @ qs, p.transpose(-1, -2) @ go


class _BlockSparseAttention(torch.autograd.Function):
    """Exact P-EAGLE attention: per chunk, flash over the band + a dense op over the chain.

    The band part runs the CPU flash kernel (plain matmuls on other devices) over a
    view of the chunk's key run; the chain part (at most ``K - 1`` keys per row) is
    a small dense product over gathered keys; the two are merged through their
    log-sum-exps. The backward calls the flash backward with the merged output and
    log-sum-exp, which makes its band gradients those of the full softmax, and adds
    the chain's by hand. Saved for backward: ``q, k, v``, the output and one
    log-sum-exp per row; gradients are accumulated into one buffer each, never a
    full-size tensor per chunk.

    ``forward_dtype`` (optional): the forward computes in it from casts of ``q, k, v``,
    and the output comes back in their dtype; the backward runs in their dtype from
    the originals and that forward's output and log-sum-exp.
    """

    @staticmethod
    def forward(ctx, q, k, v, chunks, scale, forward_dtype=None):
        saved = (q, k, v)
        if forward_dtype is not None:
            q, k, v = (t.to(forward_dtype) for t in saved)
        kv_heads = k.shape[1]
        g = q.shape[1] // kv_heads
        n = q.shape[2]
        out = q.new_zeros(1, n, q.shape[1], v.shape[-1]).transpose(1, 2)  # [1, nh, N, hd]
        lse = torch.zeros(
            1, q.shape[1], n, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device
        )
        for c in chunks:
            qs = _grouped(q.index_select(2, c.rows), kv_heads)
            o, o_lse = _band_attention(qs, k, v, c, g, scale)
            if c.chain is not None:
                kc, vc = _chain_kv(k, v, c)
                s = _chain_scores(qs, kc, c, scale)
                merged = torch.logaddexp(o_lse, torch.logsumexp(s, -1))
                o = o * torch.exp(o_lse - merged).unsqueeze(-1).to(o.dtype)
                p = torch.exp(s - merged.unsqueeze(-1)).to(vc.dtype)
                o += _chain_weighted(p, vc)
                o_lse = merged
            out.index_copy_(2, c.rows, _ungrouped(o))
            lse.index_copy_(2, c.rows, _ungrouped(o_lse))
        out = out.to(saved[0].dtype)
        ctx.save_for_backward(*saved, out, lse)
        ctx.chunks, ctx.scale = chunks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        chunks, scale = ctx.chunks, ctx.scale
        kv_heads = k.shape[1]
        g = q.shape[1] // kv_heads
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for c in chunks:
            qs, go, os, ls = (
                _grouped(t.index_select(2, c.rows), kv_heads) for t in (q, grad_out, out, lse)
            )
            dq = None
            if c.k1 > c.k0:
                ks = k[:, :, c.k0 : c.k1].expand(g, -1, -1, -1)
                vs = v[:, :, c.k0 : c.k1].expand(g, -1, -1, -1)
                dq, dk, dv = _band_backward(go, qs, ks, vs, os, ls, _band_mask(c, q.dtype), scale)
                grad_k[:, :, c.k0 : c.k1] += dk.sum(0, keepdim=True)
                grad_v[:, :, c.k0 : c.k1] += dv.sum(0, keepdim=True)
            if c.chain is not None:
                # softmax backward restricted to the chain keys: dS = P * (dP - rowsum(dO * O))
                kc, vc = _chain_kv(k, v, c)
                p = torch.exp(_chain_scores(qs, kc, c, scale) - ls.unsqueeze(-1)).to(q.dtype)
                delta = (go * os).sum(-1, keepdim=True)
                ds = p * (_chain_dot(go, vc) - delta) * scale
                dq_chain = _chain_weighted(ds, kc)
                dq = dq_chain if dq is None else dq.add_(dq_chain)
                idx = c.chain.reshape(-1)
                grad_k[0].transpose(0, 1).index_add_(0, idx, _chain_outer(ds, qs))
                grad_v[0].transpose(0, 1).index_add_(0, idx, _chain_outer(p, go))
            if dq is not None:
                grad_q.index_copy_(2, c.rows, _ungrouped(dq))
        return grad_q, grad_k, grad_v, None, None, None


def _band_attention(qs, k, v, c: _Chunk, g: int, scale: float):
    """Attention of grouped queries ``qs`` over the chunk's band alone: ``(out, lse)``."""
    if c.k1 == c.k0:  # no row has a band: an empty softmax term
        acc = torch.promote_types(qs.dtype, torch.float32)
        empty_lse = qs.new_full(qs.shape[:-1], float("-inf"), dtype=acc)
        return qs.new_zeros(qs.shape[:-1] + (v.shape[-1],)), empty_lse
    ks = k[:, :, c.k0 : c.k1].expand(g, -1, -1, -1)
    vs = v[:, :, c.k0 : c.k1].expand(g, -1, -1, -1)
    o, o_lse = _band_forward(qs, ks, vs, _band_mask(c, qs.dtype), scale)
    if c.no_band is not None:  # the CPU kernel reports lse 0 for a fully masked row
        o_lse = o_lse.masked_fill(c.no_band, float("-inf"))
    return o, o_lse


def _chain_kv(k, v, c: _Chunk):
    """Rollout keys and values of the chunk's rows: ``[C, r, nkv, hd]`` each.

    Gathered along ``N`` from the ``[N, nkv, hd]`` view (the projections' own memory
    order), so only the picked rows are copied.
    """
    idx = c.chain.reshape(-1)
    shape = (*c.chain.shape, *k.shape[1:2], -1)
    kc = k[0].transpose(0, 1).index_select(0, idx).view(shape)
    return kc, v[0].transpose(0, 1).index_select(0, idx).view(shape)


def _chain_scores(qs, kc, c: _Chunk, scale: float) -> torch.Tensor:
    """``[g, nkv, C, r]`` scaled scores of grouped rows against their rollout keys."""
    s = _chain_dot(qs, kc) * scale
    s = s.to(torch.promote_types(s.dtype, torch.float32))
    return s.masked_fill(~c.chain_ok, float("-inf"))


# The chain products below contract over r <= K - 1 keys per row. As batched matmuls they
# would be one 1 x hd x r product per row and head, each paying a matmul call's overhead
# for a handful of multiply-adds; a broadcast multiply and sum does the same arithmetic
# in one elementwise pass.


def _chain_dot(x: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
    """``[g, nkv, C, hd], [C, r, nkv, hd] -> [g, nkv, C, r]``: each row against its own keys."""
    return (x.unsqueeze(3) * kc.permute(2, 0, 1, 3)).sum(-1)


def _chain_weighted(w: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """``[g, nkv, C, r], [C, r, nkv, hd] -> [g, nkv, C, hd]``: weighted sums of each row's keys."""
    return (w.unsqueeze(-1) * vc.permute(2, 0, 1, 3)).sum(3)


def _chain_outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Group-summed outer products: ``[g, nkv, C, r], [g, nkv, C, hd] -> [C * r, nkv, hd]``."""
    return torch.einsum("ghcj,ghcD->cjhD", a, b).flatten(0, 1)
