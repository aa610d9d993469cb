"""Attention over the flattened COD sequence: flex on CUDA, the exact block-sparse path on CPU.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements of the flat
sequence, ``L`` tokens of the row, ``nh`` / ``nkv`` query / key-value heads, ``hd`` head dim.

:class:`PEagleMask` holds one sequence's mask in the form each path needs (a flex
``BlockMask`` read off the COD layout by :mod:`.cod_block_mask`, or the query chunks of
:mod:`.block_sparse`), built on first use; :func:`peagle_attention` picks the path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..common.errors import UserError
from ..core.peagle_attention import create_peagle_mask_mod, lengths_from_document_ids
from . import flex
from .block_sparse import _BlockSparseAttention, _Chunk, _plan_chunks
from .cod_block_mask import cod_block_mask
from .flex import _peagle_flex_attention

AttentionImpl = Literal["auto", "flex", "chunked"]
ATTENTION_IMPLS = ("auto", "flex", "chunked")


def resolve_attention_impl(impl: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``chunked`` elsewhere; a forced choice is checked."""
    if impl not in ATTENTION_IMPLS:
        raise UserError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}.")
    if impl == "auto":
        return "flex" if device.type == "cuda" else "chunked"
    return impl


@dataclass
class PEagleMask:
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
            self._cache["block_mask"] = cod_block_mask(
                self.anchor_pos, self.depth, self.document_ids, self.sliding_window,
                mask_mod=self.mask_mod,
            )
        return self._cache["block_mask"]

    @property
    def chunks(self) -> list[_Chunk]:
        """The query chunks of the CPU path (see :func:`_plan_chunks`); padding rows skipped."""
        if "chunks" not in self._cache:
            self._cache["chunks"] = _plan_chunks(
                self.anchor_pos, self.depth, self.document_ids, self.sliding_window
            )
        return self._cache["chunks"]


def _chunked_attention(q, k, v, mask: PEagleMask, scale, forward_dtype=None) -> torch.Tensor:
    """Exact masked attention over ``mask``'s chunks (see :class:`_BlockSparseAttention`)."""
    return _BlockSparseAttention.apply(q, k, v, mask.chunks, scale, forward_dtype)


def peagle_attention(q, k, v, mask: PEagleMask | BlockMask, scale: float) -> torch.Tensor:
    """Attention of ``q [1, nh, N, hd]`` over ``k, v [1, nkv, N, hd]`` under ``mask``.

    A ``BlockMask`` (:attr:`PEagleMask.block_mask`, built before a compiled region) runs
    plain ``flex_attention``, for the compiler of the region around it to lower. Every flex
    call takes contiguous ``q, k, v`` (:func:`.flex.flex_inputs`).

    Under ``torch.autocast`` the kernels run with autocast off (it would lower every
    ``einsum``, softmax statistics included), and the forward computes in the autocast
    dtype, as ``scaled_dot_product_attention`` would in speculators' ``Trainer``.
    On CUDA the backward follows it. On CPU the backward runs in float32, from float32
    ``q, k, v`` and the forward's output and log-sum-exp, because the CPU flash kernel's
    bfloat16 backward is slower than its float32 one. Why not all float32: a draft trained
    with a float32 forward here came out worse at depths >= 1 in held-out accuracy (the
    comparison is in eval/RESULTS.md).
    """
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            if device == "cpu" and getattr(mask, "impl", None) == "chunked":
                q, k, v = (t.float() for t in (q, k, v))
                return _chunked_attention(q, k, v, mask, scale, forward_dtype=dtype)
            return peagle_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, scale)
    if isinstance(mask, BlockMask):
        q, k, v = flex.flex_inputs(q, k, v)
        return flex_attention(q, k, v, block_mask=mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1])
    if mask.impl == "flex":
        if not flex._peagle_compile_supported(q, k, v):  # CPU, tiny heads: flex runs eager
            return _peagle_flex_attention(q, k, v, mask.block_mask, scale)
        if flex.signature(q, k, v) not in flex.compile_failures:
            out = flex.compiled_flex_attention(q, k, v, mask.block_mask, scale)
            if out is not None:
                return out
    return _chunked_attention(q, k, v, mask, scale)
