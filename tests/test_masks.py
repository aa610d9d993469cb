"""Mask mod: brute-force loop oracle, the seed's worked example, flex usability."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from speculators_peagle_plugin import (
    create_peagle_mask_mod,
    dense_peagle_mask,
    document_ids_from_lengths,
    generate_cod_sample_indices,
    lengths_from_document_ids,
)
from speculators_peagle_plugin.core.peagle_attention import document_starts
from speculators_peagle_plugin.selftest.oracles import brute_force_mask, masked_attention
from speculators_peagle_plugin.selftest.rows import ragged_lengths

EXAMPLE_ANCHOR = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0])
EXAMPLE_DEPTH = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
# Worked by hand from the rule: row i lists the keys element i sees.
EXAMPLE_ROWS = {
    0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 2, 3}, 4: {0, 1, 2, 3, 4},
    5: {0, 1, 2, 3, 4, 5}, 6: {0, 6}, 7: {0, 1, 7}, 8: {0, 1, 2, 3, 8},
    9: {0, 1, 2, 3, 4, 9}, 10: {0, 6, 10}, 11: {0, 1, 2, 3, 8, 11}, 12: {0, 6, 10, 12},
}


def packed_sample(seed, total_seq_len, n_docs, pad, num_depths=5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(ragged_lengths(gen, total_seq_len - pad, n_docs))
    doc = document_ids_from_lengths(lengths, total_seq_len)
    loss_mask = (torch.rand(total_seq_len, generator=gen) < 0.8).long()
    anchor, depth = generate_cod_sample_indices(
        total_seq_len, loss_mask, num_depths, 0.8, 0.2, document_ids=doc, generator=gen
    )
    return anchor, depth, lengths


def test_worked_example_from_the_seed():
    mask = dense_peagle_mask(EXAMPLE_ANCHOR, EXAMPLE_DEPTH, torch.tensor([6]), 6)
    for q, keys in EXAMPLE_ROWS.items():
        assert set(torch.nonzero(mask[q]).flatten().tolist()) == keys, q


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "total_seq_len,n_docs,pad,window",
    [(61, 1, 0, None), (97, 3, 11, None), (150, 4, 7, 9), (211, 2, 40, 1)],
)
def test_matches_brute_force_on_packed_rows(seed, total_seq_len, n_docs, pad, window):
    anchor, depth, lengths = packed_sample(seed, total_seq_len, n_docs, pad)
    expected = brute_force_mask(anchor, depth, lengths.tolist(), total_seq_len, window)
    dense = dense_peagle_mask(anchor, depth, lengths, total_seq_len, sliding_window=window)
    assert torch.equal(dense, expected)
    mask_mod = create_peagle_mask_mod(anchor, depth, lengths, total_seq_len, sliding_window=window)
    n = anchor.shape[0]
    assert torch.equal(create_mask(mask_mod, None, None, n, n, device="cpu")[0, 0], expected)


def test_closure_name_names_its_parameters():
    a, d = EXAMPLE_ANCHOR, EXAMPLE_DEPTH
    assert create_peagle_mask_mod(a, d, torch.tensor([6]), 6).__name__ == "peagle_mask"
    named = create_peagle_mask_mod(a, d, torch.tensor([6]), 6, sliding_window=64)
    assert named.__name__ == "peagle_mask_sliding_window_64"


@pytest.mark.parametrize("seed", range(3))
def test_block_mask_drives_flex_attention_like_the_dense_mask(seed):
    # 300 elements: not a multiple of the 128 block size.
    anchor, depth, lengths = packed_sample(seed, 131, 3, 5, num_depths=4)
    n = anchor.shape[0]
    mask_mod = create_peagle_mask_mod(anchor, depth, lengths, 131)
    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu")
    dense = dense_peagle_mask(anchor, depth, lengths, 131)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    out = flex_attention(q, k, v, block_mask=block_mask)
    # Padding queries see nothing: compare only rows with at least one visible key.
    rows = dense.any(-1)
    ref = masked_attention(q, k, v, dense, 1 / 4.0)
    torch.testing.assert_close(out[..., rows, :], ref[..., rows, :])


def test_lengths_document_ids_round_trip():
    doc = document_ids_from_lengths(torch.tensor([2, 3]), 7)
    assert doc.tolist() == [0, 0, 1, 1, 1, -1, -1]
    assert lengths_from_document_ids(doc[None]).tolist() == [2, 3]
    assert document_starts(doc).tolist() == [0, 0, 2, 2, 2, 5, 5]


@pytest.mark.parametrize(
    "args,kwargs,needle",
    [
        ((EXAMPLE_ANCHOR, EXAMPLE_DEPTH, torch.tensor([4, 3]), 6), {}, "lengths sum to 7"),
        ((EXAMPLE_ANCHOR, EXAMPLE_DEPTH[:5], torch.tensor([6]), 6), {}, "same length"),
        ((EXAMPLE_ANCHOR, EXAMPLE_DEPTH, torch.tensor([6]), 6), {"sliding_window": 0}, "window"),
        ((EXAMPLE_ANCHOR, EXAMPLE_DEPTH, torch.tensor([-1]), 6), {}, "lengths must be >= 0"),
    ],
)
def test_bad_input(args, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        create_peagle_mask_mod(*args, **kwargs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", range(4))
def test_mask_equals_speculators_on_single_document_rows(seed, window):
    """speculators' own mask_mod, evaluated pair by pair, is ours on one-document rows."""
    from speculators.models.peagle.attention import (
        create_peagle_mask_mod as speculators_mask_mod,
    )

    gen = torch.Generator().manual_seed(seed)
    total = 37 + 11 * seed
    used = total - seed  # trailing padding on all but the first row
    loss_mask = (torch.rand(total, generator=gen) < 0.8).long()
    loss_mask[0] = 0
    doc = document_ids_from_lengths(torch.tensor([used]), total)
    anchor, depth = generate_cod_sample_indices(
        total, loss_mask, 4, 0.8, 0.2, document_ids=doc, generator=gen
    )
    ours = create_peagle_mask_mod(anchor, depth, torch.tensor([used]), total, sliding_window=window)
    theirs = speculators_mask_mod(anchor, depth, doc, sliding_window=window)
    q, k = torch.meshgrid(torch.arange(len(anchor)), torch.arange(len(anchor)), indexing="ij")
    zero = torch.tensor(0)
    assert torch.equal(ours(zero, zero, q, k), theirs(zero, zero, q, k))
