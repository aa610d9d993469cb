"""The flex ``BlockMask`` of the P-EAGLE mask, read off the COD layout, no mask evaluated.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``N`` COD elements (depth-major,
ascending anchor within a depth), ``L`` tokens of the row, ``K`` depths; ``nb`` blocks of
``block`` elements per side; ``P`` non-empty blocks.

``create_block_mask`` evaluates the rule on every (query, key) pair: ``N**2`` work, and
eagerly ``N**2`` memory. The layout fixes every block without that: by
:func:`~speculators_peagle_plugin.core.peagle_attention.visible_depth0_anchors`, a query's
depth-0 keys are ONE contiguous run of element indices (depth 0 is sorted by anchor), and
its other keys are its own rollout, at most ``K - 1`` elements found by binary search. So
a query block's non-empty key blocks are the union of its queries' runs (in blocks) plus
its rollouts' blocks, and a block is full exactly when it lies inside every one of its
queries' runs. Work and memory grow with ``N * K`` and ``P``, never with ``N**2``.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..core.peagle_attention import visible_depth0_anchors

BLOCK = 128  # flex attention's default sparse block, as create_block_mask's


def cod_block_mask(
    anchor_pos: torch.Tensor,
    depth: torch.Tensor,
    document_ids: torch.Tensor,
    sliding_window: int | None = None,
    *,
    mask_mod=None,
    block: int = BLOCK,
    full_width: bool | None = None,
) -> BlockMask:
    """``create_block_mask(mask_mod, None, None, N, N, BLOCK_SIZE=block)`` for the P-EAGLE
    mask of these elements, built from their layout.

    Args:
        anchor_pos, depth: ``[N]`` elements, depth-major, ascending anchor within a depth
            (as the COD sampler and the partition plan emit them).
        document_ids: ``[L]`` document per position, packed from 0, -1 padding after.
        sliding_window: the window of the depth-0 branch, or ``None``.
        mask_mod: the rule the kernels apply inside partial blocks
            (:func:`~speculators_peagle_plugin.core.peagle_attention.create_peagle_mask_mod`
            of the same elements).
        full_width: index lists ``nb`` wide, as ``create_block_mask``'s, which Inductor's
            CPU flex kernel requires; otherwise as wide as the longest list (entries past
            a row's count are never read), so memory grows with ``P``, not ``nb**2``.
            ``None``: full width on the CPU only.

    Returns:
        A ``BlockMask`` with the same partial and full blocks, forward and transposed, as
        ``create_block_mask``'s.

    Example: one document of 6 tokens, ``block = 2``, elements
    ``anchor [0..5, 0,1,3,4, 0,3, 0]``, ``depth [0]*6 + [1]*4 + [2]*2 + [3]``: query block 0
    (anchors 0, 1 at depth 0) holds key block 0 partially (query 0 misses key 1); query
    block 2 (anchors 4, 5) holds key blocks 0 and 1 fully and key block 2 partially.
    """
    n = anchor_pos.shape[0]
    num_depths = int(depth.max()) + 1 if n else 1
    _check_layout(anchor_pos, depth, num_depths, block)
    nb = -(-n // block)
    if full_width is None:
        full_width = anchor_pos.device.type == "cpu"
    valid = document_ids[anchor_pos] >= 0
    lo, hi = _depth0_runs(anchor_pos, depth, document_ids, sliding_window)
    seen = valid & (lo <= hi)
    q0 = torch.nonzero(seen).squeeze(1)
    context = _union_of_runs(q0 // block, lo[q0] // block, hi[q0] // block, nb)
    q, k = _rollout_pairs(anchor_pos, depth, valid, num_depths)
    nonempty = torch.unique(torch.cat([context, q // block * nb + k // block]))
    full = _full_blocks(lo, hi, seen, n, nb, block)
    partial = nonempty[~torch.isin(nonempty, full)]
    kv_num, kv_idx = _ordered(partial // nb, partial % nb, nb, full_width)
    full_kv_num, full_kv_idx = _ordered(full // nb, full % nb, nb, full_width)
    q_num, q_idx = _ordered(partial % nb, partial // nb, nb, full_width)
    full_q_num, full_q_idx = _ordered(full % nb, full // nb, nb, full_width)
    return BlockMask(
        (n, n), kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num,
        full_q_idx, BLOCK_SIZE=(block, block),
        mask_mod=mask_mod if mask_mod is not None else _no_mask_mod,
    )


def _no_mask_mod(b, h, q_idx, kv_idx):
    raise RuntimeError("cod_block_mask was built without its mask_mod.")


def _check_layout(anchor_pos, depth, num_depths: int, block: int) -> None:
    """Depth-major, ascending anchor within a depth; fewer depths than a block's rows.

    The second makes a full block of depth >= 1 keys impossible: every query of a full
    block sees the key, so all ``block`` of them share its anchor, one per depth.
    """
    if num_depths >= block:
        raise ValueError(f"cod_block_mask takes fewer than {block} depths, got {num_depths}.")
    order = depth * (int(anchor_pos.max()) + 1 if anchor_pos.numel() else 1) + anchor_pos
    if bool((order[1:] <= order[:-1]).any()):
        raise ValueError("cod_block_mask needs elements depth-major, ascending anchor within "
                         "a depth (as generate_cod_sample_indices emits them).")


def _depth0_runs(anchor_pos, depth, document_ids, sliding_window):
    """Each query's depth-0 keys as element indices ``[lo, hi]`` (empty where lo > hi)."""
    n0 = int((depth == 0).sum())
    anchors0 = anchor_pos[:n0].contiguous()
    first, last = visible_depth0_anchors(anchor_pos, depth, document_ids, sliding_window)
    lo = torch.searchsorted(anchors0, first)
    hi = torch.searchsorted(anchors0, last, right=True) - 1
    return lo, hi


def _rollout_pairs(anchor_pos, depth, valid, num_depths: int):
    """``(q, k)`` element pairs where ``k`` is a depth >= 1 element of ``q``'s rollout at
    a depth ``<= depth_q``: at most ``(K - 1) * N`` pairs, one binary search per depth."""
    counts = torch.bincount(depth, minlength=num_depths).tolist()
    starts = [sum(counts[:d]) for d in range(num_depths)]
    qs, ks = [], []
    for d in range(1, num_depths):
        if counts[d] == 0:
            continue
        anchors_d = anchor_pos[starts[d] : starts[d] + counts[d]].contiguous()
        q = torch.nonzero(valid & (depth >= d)).squeeze(1)
        j = torch.searchsorted(anchors_d, anchor_pos[q]).clamp(max=counts[d] - 1)
        hit = anchors_d[j] == anchor_pos[q]
        qs.append(q[hit])
        ks.append(j[hit] + starts[d])
    empty = anchor_pos.new_empty(0)
    return (torch.cat(qs), torch.cat(ks)) if qs else (empty, empty)


def _union_of_runs(row, start, end, nb: int) -> torch.Tensor:
    """Block codes ``row * nb + col`` of the union, per row, of the runs ``[start, end]``.

    Runs sorted by (row, start) merge where one starts past the running end of those
    before it in its row; the merged runs are then listed block by block.
    """
    if row.numel() == 0:
        return row
    order = torch.argsort(row * nb + start)
    row, start, end = row[order], start[order], end[order]
    reach = torch.cummax(row * nb + end, 0).values  # the row's running end, offset by row
    new = torch.ones_like(row, dtype=torch.bool)
    new[1:] = (row[1:] != row[:-1]) | (row[1:] * nb + start[1:] > reach[:-1] + 1)
    heads = torch.nonzero(new).squeeze(1)
    tails = torch.cat([heads[1:] - 1, heads.new_tensor([row.numel() - 1])])
    first = row[heads] * nb + start[heads]
    return _spans(first, reach[tails] - first + 1)


def _full_blocks(lo, hi, seen, n: int, nb: int, block: int) -> torch.Tensor:
    """Codes of the full blocks: whole query blocks whose every query sees a whole key
    block inside its depth-0 run, i.e. inside ``[max lo, min hi]`` over the block."""
    rows = n // block  # whole query blocks; a ragged last block is never full
    if rows == 0:
        return lo.new_empty(0)
    cut = rows * block
    every = seen[:cut].view(rows, block).all(1)
    first = (lo[:cut].view(rows, block).amax(1) + block - 1) // block
    last = (hi[:cut].view(rows, block).amin(1) + 1) // block - 1
    count = torch.where(every, (last - first + 1).clamp(min=0), 0)
    row = torch.arange(rows, device=lo.device)
    return _spans(row * nb + first, count)


def _spans(first: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``first[i], first[i] + 1, ..., first[i] + count[i] - 1`` for every ``i``, in order."""
    total = int(count.sum())
    offsets = torch.cumsum(count, 0) - count
    base = torch.repeat_interleave(first - offsets, count, output_size=total)
    return base + torch.arange(total, device=first.device)


def _ordered(row: torch.Tensor, col: torch.Tensor, nb: int, full_width: bool):
    """``(num [1, 1, nb], indices [1, 1, nb, width])`` int32: each row's columns ascending,
    ``width`` ``nb`` or the longest row's count (at least 1); unused entries 0."""
    codes, _ = torch.sort(row * nb + col)
    row, col = codes // nb, codes % nb
    num = torch.bincount(row, minlength=nb)
    width = nb if full_width else max(int(num.max()) if num.numel() else 0, 1)
    slot = torch.arange(row.numel(), device=row.device) - (torch.cumsum(num, 0) - num)[row]
    indices = torch.zeros(nb, width, dtype=torch.int32, device=row.device)
    indices[row, slot] = col.to(torch.int32)
    return num.to(torch.int32)[None, None], indices[None, None]
