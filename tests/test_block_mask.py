"""The flex BlockMask of the P-EAGLE mask, read off the COD layout.

Oracle: torch's own ``create_block_mask``, which evaluates the mask rule on every
(query, key) pair, on ragged packed rows (several documents, padding, windows, every
depth, rows that lose context elements as a partition's do, lengths that are not
multiples of the block) over several seeds and block sizes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from speculators_peagle_plugin.core.peagle_attention import (
    dense_peagle_mask,
    lengths_from_document_ids,
)
from speculators_peagle_plugin.kernels.attention import PEagleMask
from speculators_peagle_plugin.kernels.cod_block_mask import cod_block_mask
from speculators_peagle_plugin.selftest.rows import random_cod_elements

LISTS = (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
         ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices"))


def block_lists(mask, num: str, idx: str) -> list[list[int]]:
    """Each row's block list (entries past a row's count are never read)."""
    counts = getattr(mask, num).flatten().tolist()
    rows = getattr(mask, idx).flatten(0, -2)
    return [rows[r, :c].tolist() for r, c in enumerate(counts)]


def assert_same_block_mask(got, want):
    """Same partial and full blocks, forward and transposed (the backward's lists)."""
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for num, idx in LISTS:
        assert getattr(got, num).shape == getattr(want, num).shape, num
        assert block_lists(got, num, idx) == block_lists(want, num, idx), idx


def _elements(seed, length, window, drop, depths=6):
    anchor, depth, doc = random_cod_elements(seed, length=length, num_depths=depths,
                                             drop_context=drop)
    return anchor, depth, doc, PEagleMask(anchor, depth, doc, window, "flex").mask_mod


# ragged rows of several documents and padding: both sizes, windows down to 1, elements
# dropped as a partition's are, 16-element blocks (many per row) and flex's 128
CASES = [*itertools.product((0, 1, 2), (37, 300), (None, 1, 3, 17), (False, True), (16,)),
         *itertools.product((3,), (300,), (None, 17), (False, True), (128,))]


@pytest.mark.parametrize("seed,length,window,drop,block", CASES)
def test_the_layout_gives_create_block_masks_blocks(seed, length, window, drop, block):
    anchor, depth, doc, mask_mod = _elements(seed, length, window, drop)
    n = anchor.numel()
    want = create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=block)
    for full_width in (True, False):
        got = cod_block_mask(anchor, depth, doc, window, mask_mod=mask_mod, block=block,
                             full_width=full_width)
        assert_same_block_mask(got, want)
        width = got.kv_indices.shape[-1]
        assert width == want.kv_indices.shape[-1] if full_width else width <= -(-n // block)


def test_every_depth_and_a_single_element_last_block():
    """K = 8, a row whose element count is one past a multiple of the block: the last
    query block is one element, its own rollout's last key (a full 1 x 1 block in the
    dense mask, but create_block_mask pads ragged blocks, so never full)."""
    for seed in range(40):
        anchor, depth, doc, mask_mod = _elements(seed, 61, None, False, depths=8)
        if anchor.numel() % 16 == 1:
            break
    n = anchor.numel()
    assert n % 16 == 1 and int(depth.max()) == 7
    want = create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=16)
    assert_same_block_mask(cod_block_mask(anchor, depth, doc, mask_mod=mask_mod, block=16), want)


def test_flex_attention_under_the_layout_mask_is_the_dense_masked_attention():
    anchor, depth, doc, mask_mod = _elements(3, 300, 17, False)
    n = anchor.numel()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dense = dense_peagle_mask(anchor, depth, lengths_from_document_ids(doc), doc.numel(),
                              sliding_window=17)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense)
    got = flex_attention(q, k, v, block_mask=cod_block_mask(anchor, depth, doc, 17,
                                                            mask_mod=mask_mod), enable_gqa=True)
    seen = dense.any(-1)  # a padding query sees nothing: its output is undefined either way
    torch.testing.assert_close(got[:, :, seen], want[:, :, seen])


def test_elements_out_of_order_or_too_many_depths_are_refused():
    anchor, depth, doc, _ = _elements(0, 37, None, False)
    with pytest.raises(ValueError, match="depth-major"):
        cod_block_mask(anchor.flip(0), depth.flip(0), doc)
    with pytest.raises(ValueError, match="fewer than 16 depths"):
        cod_block_mask(torch.arange(16), torch.arange(16), torch.zeros(32, dtype=torch.long),
                       block=16)


def test_the_build_grows_with_the_row_not_its_square():
    """Index lists no wider than the longest list: a windowed row of 16x the tokens holds
    about 16x the entries (the squared growth would be 256x)."""
    sizes = []
    for length in (512, 8192):
        anchor, depth, doc = random_cod_elements(0, length=length, num_depths=8)
        mask = cod_block_mask(anchor, depth, doc, 64, full_width=False)
        sizes.append(sum(getattr(mask, idx).numel() for _, idx in LISTS))
    assert 8 < sizes[1] / sizes[0] < 32


@pytest.mark.slow
def test_the_memory_benchmark_runs_shortened():
    """eval/bench_block_mask.py at one short row: a row per build."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "eval.bench_block_mask", "--lengths", "256"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, check=True, timeout=600)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| 256 ")]
    assert [r[2].strip() for r in rows] == ["create_block_mask", "create_block_mask compiled",
                                           "COD layout (ours)", "COD layout, window 2048 (ours)"]
    assert len({r[1] for r in rows}) == 1 and int(rows[0][1]) > 256  # one COD row, >1 depth
    assert all(float(r[3]) >= 0 and float(r[4]) >= 0 for r in rows if r[3].strip() != "-")
