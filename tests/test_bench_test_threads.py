"""Each pytest worker's share of the cores (tests/conftest.py), and
``eval.bench_test_threads``, which measures why it has one, run shortened."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKERS

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(WORKERS == 1, reason="one pytest process keeps torch's default threads")
def test_a_worker_and_what_it_starts_get_their_share_of_the_cores():
    share = max(1, len(os.sched_getaffinity(0)) // WORKERS)
    assert torch.get_num_threads() == share
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) == share


def test_the_benchmark_runs_shortened():
    done = subprocess.run(
        [sys.executable, "-m", "eval.bench_test_threads", "--steps", "1", "--repeats", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[2].startswith("| round | default threads")
    cells = [c.strip() for c in lines[4].strip("|").split("|")]
    assert cells[0] == "1" and float(cells[1]) > 0 and float(cells[2]) > 0
    assert cells[3].endswith("x")
