"""Attention over the flattened COD sequence: flex on CUDA, exact block-sparse SDPA on CPU.

Legend: ``N`` = COD elements in the (segment's) flat sequence, ``H`` / ``Hkv`` =
query / key-value heads, ``D`` = head dim, ``C`` = query chunk, ``R`` = keys a
chunk may see.

Why a CPU path of our own: torch 2.13's ``flex_attention`` has no backward on CPU
(and Inductor's CPU flex backward fails), and SDPA over a dense ``N x N`` mask
computes every score whatever the mask allows. The P-EAGLE mask is structured:
a query sees a causal range of depth-0 context plus at most ``K - 1`` elements of
its own rollout. So each chunk of queries (one depth, ascending anchor) needs
only the depth-0 keys in ``[min lo, max anchor]`` and, per deeper depth, the
contiguous run of elements whose anchors fall in the chunk's anchor range. SDPA
(the CPU flash kernel, O(C) memory, with its own backward) runs on that
sub-problem under the exact mask restricted to it: the result is the dense
masked attention, computed on about ``N * L / 2`` scores instead of ``N**2``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .masks import create_peagle_mask_mod, document_starts, lengths_from_document_ids

logger = logging.getLogger(__name__)

AttentionImpl = Literal["auto", "flex", "chunked"]
ATTENTION_IMPLS = ("auto", "flex", "chunked")
CHUNK_ANCHORS = 512

_peagle_flex_attention_compiled = torch.compile(
    flex_attention, mode="max-autotune-no-cudagraphs", dynamic=True
)
_peagle_flex_attention_compile_failed = False


def _peagle_compile_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether Inductor's flex-attention lowering supports these tensors (CUDA, head dim >= 16)."""
    return all(t.is_cuda for t in (q, k, v)) and min(q.shape[-1], v.shape[-1]) >= 16


def _peagle_flex_attention(q, k, v, block_mask, scale):
    """Run flex attention, compiled where Inductor supports it, else eager.

    Args:
        q: ``[1, H, N, D]``; k, v: ``[1, Hkv, N, D]``; block_mask: a flex ``BlockMask``.

    A compile failure is logged once and every later call runs eager.
    """
    global _peagle_flex_attention_compile_failed
    gqa = q.shape[1] != k.shape[1]
    if _peagle_compile_supported(q, k, v) and not _peagle_flex_attention_compile_failed:
        try:
            return _peagle_flex_attention_compiled(
                q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa
            )
        except Exception as err:  # noqa: BLE001 - any Inductor failure falls back
            _peagle_flex_attention_compile_failed = True
            logger.warning("flex_attention compile failed (%s); running eager from now on.", err)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def resolve_attention_impl(impl: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``chunked`` elsewhere; a forced choice is checked."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}.")
    if impl == "auto":
        return "flex" if device.type == "cuda" else "chunked"
    return impl


@dataclass
class PeagleMask:
    """The P-EAGLE mask of one flat COD sequence, in whichever form the path needs.

    Args:
        anchor_pos, depth: ``[N]`` per element (depth-major, ascending anchor per depth).
        document_ids: ``[L]`` document per original position, -1 padding.
        sliding_window: window of the depth-0 branch, or ``None``.
        impl: ``flex`` or ``chunked`` (see :func:`resolve_attention_impl`).
    """

    anchor_pos: torch.Tensor
    depth: torch.Tensor
    document_ids: torch.Tensor
    sliding_window: int | None
    impl: str
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def mask_mod(self):
        if "mask_mod" not in self._cache:
            doc = self.document_ids
            self._cache["mask_mod"] = create_peagle_mask_mod(
                self.anchor_pos,
                self.depth,
                lengths_from_document_ids(doc),
                doc.shape[0],
                sliding_window=self.sliding_window,
            )
        return self._cache["mask_mod"]

    @property
    def block_mask(self):
        if "block_mask" not in self._cache:
            n = self.anchor_pos.shape[0]
            self._cache["block_mask"] = create_block_mask(
                self.mask_mod, None, None, n, n, device=self.anchor_pos.device
            )
        return self._cache["block_mask"]

    @property
    def chunks(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(q_idx [C], kv_idx [R], mask [C, R])`` per query chunk; padding queries skipped."""
        if "chunks" not in self._cache:
            self._cache["chunks"] = _plan_chunks(self)
        return self._cache["chunks"]


def _plan_chunks(mask: PeagleMask) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    anchor, depth, doc = mask.anchor_pos, mask.depth, mask.document_ids
    n_depths = int(depth.max()) + 1 if depth.numel() else 0
    starts = torch.searchsorted(depth, torch.arange(n_depths + 1, device=depth.device)).tolist()
    doc_start = document_starts(doc)  # no query sees before its document's start
    plans = []
    span_edges = torch.arange(0, doc.shape[0] + CHUNK_ANCHORS, CHUNK_ANCHORS, device=doc.device)
    for d in range(n_depths):
        lo_blk, hi_blk = starts[d], starts[d + 1]
        # Chunks cover a fixed anchor span, not a fixed query count: a sparse deep depth
        # then reads about as many context keys per query as depth 0 does.
        cuts = (lo_blk + torch.searchsorted(anchor[lo_blk:hi_blk], span_edges)).tolist()
        for c0, c1 in zip(cuts[:-1], cuts[1:], strict=True):
            if c0 == c1:
                continue
            q_idx = torch.arange(c0, c1, device=anchor.device)
            q_idx = q_idx[doc[anchor[q_idx]] >= 0]  # padding queries see nothing
            if q_idx.numel() == 0:
                continue
            a_lo, a_hi = int(anchor[q_idx[0]]), int(anchor[q_idx[-1]])
            ctx_lo = int(doc_start[a_lo])
            if mask.sliding_window is not None:
                ref_lo = int((anchor[q_idx] + depth[q_idx]).min())
                ctx_lo = max(ctx_lo, ref_lo - mask.sliding_window + 1)
            pieces = []
            for dk in range(d + 1):
                blk = anchor[starts[dk] : starts[dk + 1]]
                # depth 0: the window's range, plus the chunk's own rollout anchors,
                # which stay visible through the rollout branch even when depth >= W
                lo = min(ctx_lo, a_lo) if dk == 0 else a_lo
                i0, i1 = torch.searchsorted(blk, torch.tensor([lo, a_hi + 1], device=blk.device))
                pieces.append(
                    torch.arange(starts[dk] + int(i0), starts[dk] + int(i1), device=blk.device)
                )
            kv_idx = torch.cat(pieces)
            plans.append(
                (q_idx, kv_idx, mask.mask_mod(None, None, q_idx[:, None], kv_idx[None, :]))
            )
    return plans


def _chunked_attention(q, k, v, mask: PeagleMask, scale) -> torch.Tensor:
    """Exact masked attention, one SDPA call per query chunk (see module docstring)."""
    if k.shape[1] != q.shape[1]:  # GQA: the CPU flash kernel wants equal head counts
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],))
    if not mask.chunks:
        return out
    parts = [
        F.scaled_dot_product_attention(
            q[:, :, q_idx], k[:, :, kv_idx], v[:, :, kv_idx], attn_mask=allowed, scale=scale
        )
        for q_idx, kv_idx, allowed in mask.chunks
    ]
    rows = torch.cat([q_idx for q_idx, _, _ in mask.chunks])
    return out.index_copy(2, rows, torch.cat(parts, dim=2))


def peagle_attention(q, k, v, mask: PeagleMask, scale: float) -> torch.Tensor:
    """Attention of ``q [1, H, N, D]`` over ``k, v [1, Hkv, N, D]`` under ``mask``."""
    if mask.impl == "flex":
        return _peagle_flex_attention(q, k, v, mask.block_mask, scale)
    return _chunked_attention(q, k, v, mask, scale)
