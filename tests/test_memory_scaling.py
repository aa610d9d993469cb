"""Memory linear in the row: a step at S tokens in S / 4096 partitions.

Every term of the partitioned step (the COD indices, the plan, the masks, the loss) is
linear in the row or bounded by the segment: peak memory grows with the row's own inputs,
never with its square. Oracle: the process's peak RSS in a fresh process per length,
the selftest's step on its tiny shape (speculators' defaults but a short window, so the
128K-token row runs in CI time).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from speculators_peagle_plugin.selftest import perf
from speculators_peagle_plugin.selftest.shapes import SHAPES
from speculators_peagle_plugin.training import peagle_trainer


def test_the_selftest_step_runs_one_forward_per_partition(monkeypatch):
    forwards = []
    real = peagle_trainer.PEagleTrainerModule.forward_batch

    def counting(self, batch, peagle_segment=None):
        forwards.append(peagle_segment is not None)
        return real(self, batch, peagle_segment)

    monkeypatch.setattr(peagle_trainer.PEagleTrainerModule, "forward_batch", counting)
    step = perf._ours(SHAPES["tiny"], torch.device("cpu"), "none", window=64)
    seq_len = 3 * perf.SEGMENT_TOKENS - 5
    step(perf.make_row(SHAPES["tiny"], seq_len, torch.device("cpu"), torch.float32), 0)
    assert perf.segments_for(seq_len) == 3 and forwards == [True] * 3


def _peak_gib(seq_len: int) -> float:
    spec = {"side": "ours", "shape": "tiny", "device": "cpu", "seq_lens": [seq_len],
            "warmup": 0, "steps": 1, "search_s": 0, "window": 128}
    done = subprocess.run([sys.executable, "-m", "speculators_peagle_plugin.selftest.perf",
                           json.dumps(spec)], capture_output=True, text=True, check=True,
                          timeout=900)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    record = json.loads(line.removeprefix("RESULT "))["lengths"][str(seq_len)]
    assert record["segments"] == seq_len // perf.SEGMENT_TOKENS and "error" not in record
    return record["peak_gib"]


def _row_gib(seq_len: int) -> float:
    """The row's own inputs (perf.make_row at the tiny shape): what must grow with it."""
    row = perf.make_row(SHAPES["tiny"], seq_len, torch.device("cpu"), torch.float32)
    return sum(t.numel() * t.element_size() for t in row.values()) / 2**30


@pytest.mark.slow
def test_peak_memory_grows_linearly_from_8k_to_128k_tokens():
    """From 8K to 128K tokens the peak grows by the row's inputs and a little more (its COD
    indices and plan): 1.5x the inputs' growth plus 0.1 GiB. The same row run flat (no
    partitions) grows far past it; any term in the row's square, 256-fold.
    (Two lengths: a length between them would bound a smaller growth, no other term.)"""
    lengths = (8192, 131072)
    peaks = [_peak_gib(n) for n in lengths]
    inputs = [_row_gib(n) for n in lengths]
    grown, bound = peaks[1] - peaks[0], 1.5 * (inputs[1] - inputs[0]) + 0.1
    assert grown <= bound, (lengths, peaks, inputs)
