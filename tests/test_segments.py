"""Segment assignment against a loop implementation of Algorithm 1's phases 1 and 2."""

import pytest
import torch

from speculators_peagle_plugin import assign_cod_segments, generate_cod_sample_indices


def algorithm_1(anchor, depth, seq_length, num_segments):
    """Phase 1 by boundaries B_s = ceil(s L / S), phase 2 by walking to the parent."""
    bounds = [-(-s * seq_length // num_segments) for s in range(num_segments)]

    def bucket(p):
        return max(s for s in range(num_segments) if bounds[s] <= p)

    anchor, depth = anchor.tolist(), depth.tolist()
    index = {(a, d): i for i, (a, d) in enumerate(zip(anchor, depth, strict=True))}
    seg = [None] * len(anchor)
    for i in sorted(range(len(anchor)), key=lambda i: depth[i]):
        a, d = anchor[i], depth[i]
        if d <= 1:
            seg[i] = bucket(a + d)
        else:
            seg[i] = seg[index[(a, d - 1)]]  # A^g[p] = A^{g-1}[p - 1]
    return seg


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seq_length,num_segments", [(50, 1), (97, 2), (97, 3), (200, 7), (5, 9)])
def test_matches_algorithm_1(seed, seq_length, num_segments):
    gen = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand(seq_length, generator=gen) < 0.85).long()
    anchor, depth = generate_cod_sample_indices(seq_length, loss_mask, 6, 0.8, 0.3, generator=gen)
    seg = assign_cod_segments(anchor, depth, seq_length, num_segments)
    assert seg.tolist() == algorithm_1(anchor, depth, seq_length, num_segments)
    assert int(seg.min()) >= 0 and int(seg.max()) < num_segments
    seg0 = seg[depth == 0]
    assert bool((seg0[1:] >= seg0[:-1]).all())  # non-decreasing in position
    if num_segments == 1:
        assert not seg.any()


def test_segments_larger_than_the_sequence():
    anchor = torch.arange(5)
    seg = assign_cod_segments(anchor, torch.zeros(5, dtype=torch.long), 5, 12)
    assert seg.tolist() == sorted(set(seg.tolist()))  # each position its own segment
    assert int(seg.max()) < 12


def test_worked_example():
    anchor = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 4])
    depth = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    assert assign_cod_segments(anchor, depth, 6, 2).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    "kwargs,needle",
    [(dict(num_segments=0), "num_segments"), (dict(seq_length=0), "seq_length")],
)
def test_bad_input(kwargs, needle):
    args = dict(anchor_pos=torch.arange(3), depth=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=needle):
        assign_cod_segments(**(args | dict(seq_length=3, num_segments=2) | kwargs))
