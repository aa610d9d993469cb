"""COD sampling and sequence-partition assignment for P-EAGLE.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``L`` tokens of the padded row,
``N`` COD-sampled elements, ``K`` depths, ``S`` segments. An element is a pair
``(anchor_pos, depth)``; its reference (target) position is ``anchor_pos + depth``.
"""

from __future__ import annotations

import torch

from ..common.settings import check_int_at_least
from .peagle_config import CODConfig

__all__ = ["assign_cod_segments", "generate_cod_sample_indices"]


def _flat_row(name: str, tensor: torch.Tensor, seq_length: int) -> torch.Tensor:
    """View a ``[L]`` or ``[1, L]`` tensor as ``[L]``; anything else is a ValueError."""
    if tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 1 or tensor.shape[0] != seq_length:
        raise ValueError(
            f"{name} must have shape [{seq_length}] or [1, {seq_length}] "
            f"(seq_length={seq_length}), got {list(tensor.shape)}."
        )
    return tensor


def generate_cod_sample_indices(
    seq_length: int,
    loss_mask: torch.Tensor,
    num_depths: int = CODConfig.num_depths,
    down_sample_ratio: float = CODConfig.down_sample_ratio,
    down_sample_ratio_min: float = CODConfig.down_sample_ratio_min,
    filter_position_zero: bool = True,
    *,
    document_ids: torch.Tensor | None = None,
    max_anchors: int | None = CODConfig.max_anchors,
    generator: torch.Generator | None = None,
    path_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate COD sampling indices for one (possibly packed) sequence.

    Args:
        seq_length: padded length ``L`` of the row.
        loss_mask: ``[L]`` or ``[1, L]``; non-zero marks supervised positions.
        num_depths: parallel prediction depths ``K`` (>= 1).
        down_sample_ratio: geometric decay ``r`` in (0, 1].
        down_sample_ratio_min: retention floor ``r_min`` in [0, 1].
        filter_position_zero: kept for speculators' signature. Position 0 never
            starts a chain here whatever its value: its anchor would be -1. The
            same holds for the first position of every packed document.
        document_ids: ``[L]`` or ``[1, L]`` document index per position, -1 for
            padding (speculators' packed-batch field). ``None``: one document.
        max_anchors: optional cap on the depth-1 pool (how many chains may start),
            drawn uniformly.
        generator: optional ``torch.Generator`` on ``loss_mask``'s device; ``None``
            uses the global RNG.
        path_mask: optional ``[L]`` or ``[1, L]`` bool: a chain may step from position
            ``p`` to ``p + 1`` only where ``path_mask[p]``. With "the row's token after
            ``p`` is the target's argmax at ``p``" every rollout follows the target's
            greedy path, the only rollouts greedy serving verifies. ``None``: anywhere.

    Returns:
        ``anchor_pos: [N]`` and ``depth: [N]`` (int64), depth-major, ascending
        position within a depth.

    Rule: depth 0 keeps all ``L`` positions. Depth ``d >= 1`` draws, uniformly
    without replacement, ``int((n_valid - d) * max(r**d, r_min))`` elements
    (``n_valid`` = supervised positions, capped by ``max_anchors``; the draw is
    capped by the pool). The depth-1 pool is every supervised position ``p``
    whose predecessor ``p - 1`` is in the same document; the depth-``d`` pool is
    ``p + 1`` for each drawn depth-``d-1`` reference ``p`` such that ``p + 1`` is
    supervised and in the same document. So every chain stays inside one document
    and every depth >= 1 target is supervised. With one document and
    ``loss_mask[0] == 0`` the draws (and so the output under the same RNG state)
    are speculators 0.9.0's element for element. ``path_mask`` shrinks the pools
    (a depth-``d`` reference ``q`` needs ``path_mask[q - 1]``), not the draw sizes.

    Example (one document of length 6): depth 1 draws references [1, 2, 4, 5],
    depth 2 draws [2, 5], depth 3 draws [3] ->
    ``anchor_pos = [0,1,2,3,4,5, 0,1,3,4, 0,3, 0]``,
    ``depth      = [0,0,0,0,0,0, 1,1,1,1, 2,2, 3]``.
    """
    cfg = CODConfig(num_depths, down_sample_ratio, down_sample_ratio_min, max_anchors)
    check_int_at_least("seq_length", seq_length, 1)
    loss_mask = _flat_row("loss_mask", loss_mask, seq_length)
    supervised, starts, succ_ok = _chain_rules(loss_mask, document_ids, path_mask)
    pool, n_valid = _depth_one_pool(starts, int(supervised.sum()), max_anchors, generator)
    anchors = _draw_chains(cfg, seq_length, pool, n_valid, succ_ok, generator)
    depth = torch.repeat_interleave(
        torch.arange(len(anchors), device=loss_mask.device),
        torch.tensor([a.shape[0] for a in anchors], device=loss_mask.device),
    )
    return torch.cat(anchors), depth


def _chain_rules(
    loss_mask: torch.Tensor, document_ids: torch.Tensor | None, path_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where chains may run in a ``[L]`` row: ``(supervised, starts, succ_ok)``, each
    ``[L]`` bool. ``starts[p]``: a chain may start at reference ``p`` (supervised, its
    anchor ``p - 1`` in ``p``'s document, ``path_mask[p - 1]``); ``succ_ok[p]``: a chain at
    reference ``p`` may extend to ``p + 1`` (supervised, same document, ``path_mask[p]``)."""
    seq_length, device = loss_mask.shape[0], loss_mask.device
    supervised = loss_mask != 0  # [L]
    if document_ids is not None:
        doc = _flat_row("document_ids", document_ids, seq_length).to(device)
        supervised = supervised & (doc >= 0)
        same_doc_as_next = doc[1:] == doc[:-1]  # [L-1]: positions p, p+1 share a document
    else:
        same_doc_as_next = torch.ones(seq_length - 1, dtype=torch.bool, device=device)

    starts = supervised.clone()
    starts[0] = False
    starts[1:] &= same_doc_as_next
    succ_ok = torch.zeros_like(supervised)
    succ_ok[:-1] = same_doc_as_next & supervised[1:]
    if path_mask is not None:
        steps = _flat_row("path_mask", path_mask, seq_length).to(device).bool()
        starts[1:] &= steps[:-1]
        succ_ok &= steps
    return supervised, starts, succ_ok


def _depth_one_pool(
    starts: torch.Tensor, n_valid: int, max_anchors: int | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int]:
    """The depth-1 pool (``[P]`` ascending references where ``starts``), at most
    ``max_anchors`` of them drawn uniformly, and ``n_valid`` capped by ``max_anchors``."""
    pool = torch.nonzero(starts).squeeze(1)  # [P] ascending
    if max_anchors is not None and pool.shape[0] > max_anchors:
        keep = torch.randperm(pool.shape[0], generator=generator, device=starts.device)
        pool = pool[keep[:max_anchors]].sort().values
    if max_anchors is not None:
        n_valid = min(n_valid, max_anchors)
    return pool, n_valid


def _draw_chains(
    cfg: CODConfig, seq_length: int, pool: torch.Tensor, n_valid: int, succ_ok: torch.Tensor,
    generator: torch.Generator | None,
) -> list[torch.Tensor]:
    """The anchors of each depth, depth 0 first (every position): depth ``d`` draws its
    references from the pool, which then becomes ``p + 1`` of each drawn ``p`` that
    ``succ_ok`` lets extend. Stops at the first depth whose draw size is 0."""
    device = pool.device
    anchors = [torch.arange(seq_length, device=device)]
    for d in range(1, cfg.num_depths):
        size = cfg.depth_sample_size(n_valid, d)
        if size <= 0:
            break
        if pool.shape[0] >= size:
            pick = torch.randperm(pool.shape[0], generator=generator, device=device)[:size]
            refs = pool[pick].sort().values
        else:
            refs = pool
        anchors.append(refs - d)
        pool = refs[succ_ok[refs]] + 1
    return anchors


def assign_cod_segments(
    anchor_pos: torch.Tensor,
    depth: torch.Tensor,
    seq_length: int,
    num_segments: int,
) -> torch.Tensor:
    """Assign every COD element to one of ``num_segments`` segments (Algorithm 1).

    Args:
        anchor_pos: ``[N]`` chain start per element.
        depth: ``[N]`` COD round per element.
        seq_length: padded sequence length ``L``.
        num_segments: ``S >= 1``.

    Returns:
        ``[N]`` int64 segment ids in ``[0, S)``.

    Rule: ``seg(p) = min(p * S // L, S - 1)``, i.e. boundaries ``B_s = ceil(s L / S)``.
    Phase 1 places depth 0 at ``p = anchor_pos`` and depth 1 at ``p = anchor_pos + 1``;
    phase 2 makes depth ``g >= 2`` inherit its parent's segment, and since a rollout
    keeps one anchor, that is the depth-1 ancestor's: ``p = anchor_pos + 1`` for all
    ``depth >= 1``. (Phase 3, causal completion, is the caller's: a segment also
    reads every depth-0 element of earlier-or-equal segments as key/value context.)

    Example: ``L = 6, S = 2`` (boundaries 0, 3): depth 0 at anchors 0..5 -> [0,0,0,1,1,1];
    depth 1 at anchors [0, 1, 3, 4] -> references [1, 2, 4, 5] -> [0, 0, 1, 1].
    """
    check_int_at_least("seq_length", seq_length, 1)
    check_int_at_least("num_segments", num_segments, 1)
    if anchor_pos.shape != depth.shape or anchor_pos.dim() != 1:
        raise ValueError(
            "anchor_pos and depth must be 1-D tensors of the same length, got "
            f"{list(anchor_pos.shape)} and {list(depth.shape)}."
        )
    position = anchor_pos + (depth > 0).to(anchor_pos.dtype)
    return (position * num_segments // seq_length).clamp_(0, num_segments - 1)
