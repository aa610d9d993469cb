"""The flex BlockMask of the P-EAGLE mask, built without its dense [n, n] form.

Oracle: torch's own ``create_block_mask`` over the whole mask at once (dense, fine at the
few thousand elements of these rows), on ragged packed rows over several seeds.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from speculators_peagle_plugin.kernels import flex
from speculators_peagle_plugin.kernels.attention import PEagleMask
from speculators_peagle_plugin.selftest.rows import random_cod_elements


def _mask_mod(seed: int, window, length: int = 300):
    anchor, depth, doc = random_cod_elements(seed, length=length, num_depths=8)
    return PEagleMask(anchor, depth, doc, window, "flex").mask_mod, anchor.numel()


def assert_same_block_mask(got, want):
    """Same blocks, same full blocks, same transposed (backward) lists, same dense mask."""
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                     ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        counts = getattr(want, num).flatten().tolist()
        rows_got = getattr(got, idx).flatten(0, -2)
        rows_want = getattr(want, idx).flatten(0, -2)
        for row, count in enumerate(counts):  # entries past a row's count are unused
            assert torch.equal(rows_got[row, :count], rows_want[row, :count]), (idx, row)
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.parametrize("seed,window", [(0, None), (1, 5), (2, None), (3, 17)])
def test_slabs_build_the_same_block_mask_as_create_block_mask(monkeypatch, seed, window):
    mask_mod, n = _mask_mod(seed, window)
    shapes = []
    real = flex.create_block_mask

    def recording(mod, b, h, q_len, kv_len, **kwargs):
        shapes.append((q_len, kv_len))
        return real(mod, b, h, q_len, kv_len, **kwargs)

    monkeypatch.setattr(flex, "SLAB_ELEMENTS", 3 * 128 * n)  # 3 query blocks a slab
    monkeypatch.setattr(flex, "create_block_mask", recording)
    got = flex.peagle_block_mask(mask_mod, n, torch.device("cpu"))
    want = create_block_mask(mask_mod, None, None, n, n, device="cpu")
    assert_same_block_mask(got, want)
    # never more than a slab of the mask at once; the last slab is ragged
    assert [q for q, _ in shapes] == [384] * (n // 384) + [n % 384] and n % 384 % 128
    assert {kv for _, kv in shapes} == {n}
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h in (4, 2, 2))
    assert torch.equal(flex_attention(q, k, v, block_mask=got, enable_gqa=True),
                       flex_attention(q, k, v, block_mask=want, enable_gqa=True))


def test_a_mask_within_one_slab_is_one_create_block_mask_call():
    mask_mod, n = _mask_mod(4, None, length=40)
    assert n * 128 <= flex.SLAB_ELEMENTS
    assert_same_block_mask(flex.block_mask_by_slabs(mask_mod, n, "cpu"),
                           create_block_mask(mask_mod, None, None, n, n, device="cpu"))


def test_a_failed_block_mask_compile_is_logged_once_and_built_by_slabs(monkeypatch, caplog):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor says no\n  more lines")

    monkeypatch.setattr(flex, "_block_mask_compile_supported", lambda device: True)
    monkeypatch.setattr(flex, "_peagle_block_mask_compiled", broken)
    monkeypatch.setattr(flex, "compile_failures", {})
    mask_mod, n = _mask_mod(5, 5)
    with caplog.at_level(logging.WARNING):
        first = flex.peagle_block_mask(mask_mod, n, torch.device("cpu"))
        second = flex.peagle_block_mask(mask_mod, n, torch.device("cpu"))
    assert calls == [1]  # never compiled again
    assert flex.compile_failures == {flex.BLOCK_MASK: "RuntimeError: inductor says no"}
    warnings = [r.getMessage() for r in caplog.records if "compile failed" in r.getMessage()]
    assert warnings == ["create_block_mask compile failed for the block mask (RuntimeError: "
                        "inductor says no); it is built eagerly, a slab of query rows at a "
                        "time instead."]
    want = create_block_mask(mask_mod, None, None, n, n, device="cpu")
    assert_same_block_mask(first, want)
    assert_same_block_mask(second, want)
    assert "the block mask: RuntimeError" in flex.failures_since({})


def test_the_block_mask_is_compiled_on_cuda_only():
    assert flex._block_mask_compile_supported(torch.device("cuda"))
    assert not flex._block_mask_compile_supported("cpu")


@pytest.mark.slow
def test_the_compiled_block_mask_equals_create_block_mask(monkeypatch):
    """The CUDA path's compiled create_block_mask, here compiled by Inductor for the CPU:
    over new rows (dynamic shapes) and both window settings, the same block masks."""
    monkeypatch.setattr(flex, "_block_mask_compile_supported", lambda device: True)
    monkeypatch.setattr(flex, "compile_failures", {})
    for seed, window in ((6, None), (7, None), (8, 5)):
        mask_mod, n = _mask_mod(seed, window)
        got = flex.peagle_block_mask(mask_mod, n, torch.device("cpu"))
        assert_same_block_mask(got, create_block_mask(mask_mod, None, None, n, n, device="cpu"))
    assert flex.compile_failures == {}


@pytest.mark.slow
def test_the_memory_benchmark_runs_shortened():
    """eval/bench_block_mask.py (RESULTS 13's figures) at one short row: a row per build."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "eval.bench_block_mask", "--lengths", "256"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, check=True, timeout=600)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| 256 ")]
    assert [r[2].strip() for r in rows] == ["create_block_mask", "slabs"]
    assert rows[0][1] == rows[1][1] and int(rows[0][1]) > 256  # the same COD row, >1 depth
    # a 256-token build may take under the table's resolution: a figure, never negative
    assert all(float(r[3]) >= 0 and float(r[4]) >= 0 for r in rows)
