"""The P-EAGLE cross-depth attention mask as a flex-attention ``mask_mod``.

Legend: ``L`` = padded sequence length (``total_seq_len``), ``N`` = COD elements,
``D`` = documents packed in the row.
"""

from __future__ import annotations

import torch

from .config import check_int_at_least

__all__ = [
    "create_peagle_mask_mod",
    "dense_peagle_mask",
    "document_ids_from_lengths",
    "document_starts",
    "lengths_from_document_ids",
]


def document_ids_from_lengths(lengths: torch.Tensor, total_seq_len: int) -> torch.Tensor:
    """Document index per position, -1 for padding (speculators' ``document_ids``).

    Args:
        lengths: ``[D]`` valid length of each document, packed from position 0.
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
        ``[D]`` int64 lengths. Example: [0, 0, 1, 1, 1, -1] -> [2, 3].
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
        lengths: ``[D]`` valid length of each packed document (from position 0).
        total_seq_len: padded length ``L`` of the original row.
        sliding_window: optional window ``W`` on the depth-0 branch: a context key
            must satisfy ``anchor_k > anchor_q + depth_q - W`` (speculators' rule,
            measured from the query's reference position).

    Returns:
        ``peagle_mask(b, h, q_idx, kv_idx) -> bool``, for ``create_block_mask``.

    Rule: query ``q`` sees key ``k`` iff both anchors are in the same document,
    ``q``'s document is not padding, and either ``k`` is depth 0 with
    ``anchor_k <= anchor_q`` (causal real context), or ``k`` is in ``q``'s own
    rollout (``anchor_k == anchor_q``) with ``depth_k <= depth_q``.

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
        a_q, a_k = anchor_pos[q_idx], anchor_pos[kv_idx]
        context = (depth[kv_idx] == 0) & (a_k <= a_q)
        if sliding_window is not None:
            context = context & (a_k > reference[q_idx] - sliding_window)
        rollout = (a_k == a_q) & (depth[kv_idx] <= depth[q_idx])
        d_q = elem_doc[q_idx]
        return (d_q >= 0) & (d_q == elem_doc[kv_idx]) & (context | rollout)

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
