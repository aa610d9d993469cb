"""The P-EAGLE cross-depth attention mask: the visibility rule, written once.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``L`` tokens of the packed row
(``total_seq_len``), ``N`` COD elements; ``[n_docs]`` counts the documents packed in it.

The rule is composed from four named terms (:func:`same_document`,
:func:`depth0_context`, :func:`in_window`, :func:`same_rollout`) in
:func:`peagle_visible`. The flex ``mask_mod`` evaluates it pair by pair; the CPU kernel
reads it in interval form, :func:`visible_depth0_anchors`, derived from the same terms.
"""

from __future__ import annotations

import torch

from ..common.settings import check_int_at_least

__all__ = [
    "create_peagle_mask_mod",
    "dense_peagle_mask",
    "depth0_context",
    "document_ids_from_lengths",
    "document_starts",
    "in_window",
    "lengths_from_document_ids",
    "peagle_visible",
    "same_document",
    "same_rollout",
    "visible_depth0_anchors",
]


def document_ids_from_lengths(lengths: torch.Tensor, total_seq_len: int) -> torch.Tensor:
    """Document index per position, -1 for padding (speculators' ``document_ids``).

    Args:
        lengths: ``[n_docs]`` valid length of each document, packed from position 0.
        total_seq_len: padded length ``L``.

    Returns:
        ``[L]`` int64. Example: lengths [2, 3], L = 7 -> [0, 0, 1, 1, 1, -1, -1].
    """
    check_int_at_least("total_seq_len", total_seq_len, 1)
    lengths = torch.as_tensor(lengths).reshape(-1).long()
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}.")
    used = int(lengths.sum())
    if used > total_seq_len:
        raise ValueError(
            f"lengths sum to {used}, past total_seq_len={total_seq_len}; "
            "their sum must be <= total_seq_len."
        )
    doc = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths)
    pad = torch.full((total_seq_len - used,), -1, dtype=torch.long, device=lengths.device)
    return torch.cat([doc, pad])


def lengths_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`document_ids_from_lengths` for speculators' packed rows.

    Args:
        document_ids: ``[L]`` or ``[1, L]``, documents numbered 0.. in order, -1 padding.

    Returns:
        ``[n_docs]`` int64 lengths. Example: [0, 0, 1, 1, 1, -1] -> [2, 3].
    """
    doc = document_ids.reshape(-1)
    return torch.bincount(doc[doc >= 0])


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """First position of each position's document: ``[L] -> [L]``.

    Example: document ids [0, 0, 1, 1, 1, -1] -> [0, 0, 2, 2, 2, 5].
    """
    pos = torch.arange(document_ids.shape[0], device=document_ids.device)
    new_doc = torch.ones_like(document_ids, dtype=torch.bool)
    new_doc[1:] = document_ids[1:] != document_ids[:-1]
    return torch.cummax(torch.where(new_doc, pos, 0), 0).values


# ---- the visibility rule ------------------------------------------------------------
# Query element q = (anchor_q, depth_q) and key element k = (anchor_k, depth_k); doc_* is
# the document of the element's anchor (-1: padding), reference_q = anchor_q + depth_q.


def same_document(doc_q: torch.Tensor, doc_k: torch.Tensor) -> torch.Tensor:
    """Query and key anchors in one document, and the query not padding."""
    return (doc_q >= 0) & (doc_q == doc_k)


def depth0_context(anchor_q: torch.Tensor, anchor_k: torch.Tensor, depth_k: torch.Tensor):
    """The key is committed real context: depth 0, at or before the query's anchor."""
    return (depth_k == 0) & (anchor_k <= anchor_q)


def in_window(anchor_k: torch.Tensor, reference_q: torch.Tensor, sliding_window: int):
    """The context key lies in the window ``W`` ending at the query's reference position.

    ``anchor_k > reference_q - W`` (speculators' rule): measured from ``anchor_q + depth_q``.
    """
    return anchor_k > reference_q - sliding_window


def same_rollout(anchor_q: torch.Tensor, anchor_k: torch.Tensor, depth_q: torch.Tensor, depth_k):
    """The key is in the query's own rollout (same anchor) at an earlier-or-equal depth."""
    return (anchor_k == anchor_q) & (depth_k <= depth_q)


def peagle_visible(
    anchor_q, depth_q, doc_q, reference_q, anchor_k, depth_k, doc_k, sliding_window=None
) -> torch.Tensor:
    """Whether query ``q`` sees key ``k``, elementwise over broadcastable tensors.

    ``same_document & ((depth0_context & in_window) | same_rollout)``; without a window
    the context term stands alone. The window limits the context term only, so an
    element always sees its own rollout.
    """
    context = depth0_context(anchor_q, anchor_k, depth_k)
    if sliding_window is not None:
        context = context & in_window(anchor_k, reference_q, sliding_window)
    rollout = same_rollout(anchor_q, anchor_k, depth_q, depth_k)
    return same_document(doc_q, doc_k) & (context | rollout)


def visible_depth0_anchors(
    anchor_pos: torch.Tensor,
    depth: torch.Tensor,
    document_ids: torch.Tensor,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depth-0 keys each element sees, as an inclusive anchor range ``[first, last]``.

    :func:`peagle_visible` restricted to depth-0 keys: :func:`depth0_context` gives
    ``anchor_k <= anchor_q``; :func:`same_rollout` adds ``anchor_k == anchor_q`` (depth 0
    is ``<=`` every depth); :func:`same_document` gives ``anchor_k >= doc_start(anchor_q)``,
    as documents are contiguous; :func:`in_window` gives ``anchor_k >= reference_q - W + 1``
    for the context term only, so the query's own anchor stays in. Hence
    ``first = max(doc_start, min(anchor_q, reference_q - W + 1))``, ``last = anchor_q``,
    so ``first <= last``; a sequence may still hold no depth-0 element in the range. A
    padding query sees nothing; the caller skips it.

    Args:
        anchor_pos, depth: ``[N]`` elements.
        document_ids: ``[L]`` document per position, -1 padding.

    Returns:
        ``(first [N], last [N])`` anchors. Example: one document, ``W = 2``, element
        ``(anchor 3, depth 2)``: reference 5, ``first = max(0, min(3, 4)) = 3``, so only
        the depth-0 element at anchor 3 (its own rollout).
    """
    first = document_starts(document_ids)[anchor_pos]
    if sliding_window is not None:
        window_first = torch.minimum(anchor_pos, anchor_pos + depth - sliding_window + 1)
        first = torch.maximum(first, window_first)
    return first, anchor_pos


def create_peagle_mask_mod(
    anchor_pos: torch.Tensor,
    depth: torch.Tensor,
    lengths: torch.Tensor,
    total_seq_len: int,
    *,
    sliding_window: int | None = None,
):
    """Build a ``flex_attention`` ``mask_mod`` for P-EAGLE parallel groups.

    Args:
        anchor_pos: ``[N]`` chain start position of each element.
        depth: ``[N]`` COD round of each element.
        lengths: ``[n_docs]`` valid length of each packed document (from position 0).
        total_seq_len: padded length ``L`` of the original row.
        sliding_window: optional window ``W`` on the depth-0 branch: a context key
            must satisfy ``anchor_k > anchor_q + depth_q - W`` (speculators' rule,
            measured from the query's reference position).

    Returns:
        ``peagle_mask(b, h, q_idx, kv_idx) -> bool``, for ``create_block_mask``.

    Rule (:func:`peagle_visible`): query ``q`` sees key ``k`` iff both anchors are in
    the same document, ``q``'s document is not padding, and either ``k`` is depth 0
    with ``anchor_k <= anchor_q`` (causal real context, inside the window if any), or
    ``k`` is in ``q``'s own rollout (``anchor_k == anchor_q``) with ``depth_k <= depth_q``.

    Example (one document, L = 6):
    ``anchor_pos = [0,1,2,3,4,5, 0,1,3,4, 0,3, 0]``, ``depth = [0,0,0,0,0,0, 1,1,1,1, 2,2, 3]``:
    element 11 (anchor 3, depth 2) sees elements {0, 1, 2, 3, 8, 11}.
    """
    if anchor_pos.dim() != 1 or anchor_pos.shape != depth.shape:
        raise ValueError(
            "anchor_pos and depth must be 1-D tensors of the same length, got "
            f"{list(anchor_pos.shape)} and {list(depth.shape)}."
        )
    if sliding_window is not None:
        check_int_at_least("sliding_window", sliding_window, 1)
    doc = document_ids_from_lengths(torch.as_tensor(lengths).to(anchor_pos.device), total_seq_len)
    # Index tensors live outside the closure; the closure only indexes and compares.
    elem_doc = doc[anchor_pos]  # [N]
    reference = anchor_pos + depth  # [N]

    def peagle_mask(b, h, q_idx, kv_idx):
        return peagle_visible(
            anchor_pos[q_idx],
            depth[q_idx],
            elem_doc[q_idx],
            reference[q_idx],
            anchor_pos[kv_idx],
            depth[kv_idx],
            elem_doc[kv_idx],
            sliding_window,
        )

    peagle_mask.__name__ = (
        "peagle_mask" if sliding_window is None else f"peagle_mask_sliding_window_{sliding_window}"
    )
    return peagle_mask


def dense_peagle_mask(
    anchor_pos: torch.Tensor,
    depth: torch.Tensor,
    lengths: torch.Tensor,
    total_seq_len: int,
    *,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Materialise the mask of :func:`create_peagle_mask_mod` as ``[N, N]`` bool.

    For paths that cannot take a block mask (SDPA, references). ``O(N**2)`` memory:
    the training paths here never call it on long rows.
    """
    mask_mod = create_peagle_mask_mod(
        anchor_pos, depth, lengths, total_seq_len, sliding_window=sliding_window
    )
    idx = torch.arange(anchor_pos.shape[0], device=anchor_pos.device)
    return mask_mod(None, None, idx[:, None], idx[None, :])
