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


@pytest.mark.slow
def test_peak_memory_grows_linearly_from_8k_to_128k_tokens():
    small, mid, large = (_peak_gib(n) for n in (8192, 32768, 131072))
    # 8K -> 32K adds 24K tokens, 32K -> 128K adds 96K: a linear peak adds 4x as much over
    # the second span, a quadratic term 16x
    assert large - mid <= 6 * max(mid - small, 0.02), (small, mid, large)
    assert large < 2 * small, (small, mid, large)  # the step itself stays a segment's size
