"""The sequence-partitioning plan: which COD elements each segment forward holds.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``B`` batch rows, ``L`` tokens per
row, ``N`` COD elements of a row, ``S`` segments; ``n`` elements of one unit.

Why partitioning is exact (causal completion): an element's attention reads only
depth-0 elements of earlier-or-equal anchors in its document plus its own rollout
(:func:`~speculators_peagle_plugin.core.peagle_attention.peagle_visible`). A segment
owns depth-0 elements by ``anchor`` and deeper ones by ``anchor + 1``
(:func:`~speculators_peagle_plugin.core.peagle_data.assign_cod_segments`), and also
carries every depth-0 element of earlier-or-equal segments as key/value context. So every
owned element sees, at every layer, exactly the keys it sees in the flat forward, and
each supervised element is charged in exactly one segment: the segment losses sum to the
flat loss and, through the full dependency graph, their gradients sum to the flat gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.peagle_attention import document_starts
from ..core.peagle_data import assign_cod_segments


class PlanUnit(NamedTuple):
    """One segment forward of one row: its elements, depth-major.

    Args:
        b: the batch row.
        anchor, depth, orig_positions: ``[n]`` the unit's elements (``orig_positions =
            anchor + depth``, the reference position).
        loss_positions: ``[n]`` bool, the segment's owned supervised elements (charged);
            the others are depth-0 key/value context.
    """

    b: int
    anchor: torch.Tensor
    depth: torch.Tensor
    orig_positions: torch.Tensor
    loss_positions: torch.Tensor


class _PeaglePlan:
    """Sequence-partitioning plan: one ``unit`` per non-empty ``(row, segment)``.

    A plain class on purpose: DDP scatters tensors and built-in containers in its
    inputs, and would slice a tuple of tensors along dim 0.

    Args:
        units: the :class:`PlanUnit` of each segment forward.
        total_den: the batch's supervised-element count (the one loss denominator).
        document_ids: ``[B, L]`` document per position, -1 padding.
    """

    def __init__(self, units: list[PlanUnit], total_den: torch.Tensor, document_ids=None):
        self.units = units
        self.total_den = total_den
        self.document_ids = document_ids

    def __len__(self) -> int:
        return len(self.units)


def context_reach(draft: torch.nn.Module, seq_len: int) -> int:
    """How many anchors back an element's receptive field over depth-0 rows reaches.

    With every layer windowed, each layer extends it by at most ``W - 1`` anchors, so
    ``num_layers * (W - 1)``; otherwise the whole row.
    """
    windowed = draft.sliding_window is not None and len(draft.sliding_window_indices) == len(
        draft.layers
    )
    return len(draft.layers) * (draft.sliding_window - 1) if windowed else seq_len


def row_units(
    b: int,
    anchor: torch.Tensor,
    depth: torch.Tensor,
    supervised: torch.Tensor,
    document_ids: torch.Tensor,
    num_segments: int,
    reach: int,
) -> list[PlanUnit]:
    """Split one row's COD elements into its segments' units; segments with no charge skipped.

    Args:
        anchor, depth: ``[N]`` the row's elements; supervised: ``[N]`` bool.
        document_ids: ``[L]`` document per position, -1 padding.
        num_segments: ``S``; reach: :func:`context_reach`.

    Each unit holds the segment's owned elements plus, as context, every depth-0 element
    of earlier-or-equal segments that can reach them: from the first owned element's
    document start (earlier documents are invisible at every layer), and no further back
    than ``reach`` anchors from it.
    """
    seq_len = document_ids.shape[0]
    doc_start = document_starts(document_ids)
    ref = anchor + depth
    seg = assign_cod_segments(anchor, depth, seq_len, num_segments)
    is_ctx = depth == 0
    units = []
    for s in range(num_segments):
        owned = seg == s
        charged = owned & supervised
        if not bool(charged.any()):
            continue
        first_owned = anchor[owned].min()
        first = torch.maximum(doc_start[first_owned], first_owned - reach)
        keep = owned | (is_ctx & (seg <= s) & (anchor >= first))
        units.append(PlanUnit(b, anchor[keep], depth[keep], ref[keep], charged[keep]))
    return units
