"""Benchmark: this plugin's COD sampler vs speculators 0.9.0's, side by side, one process.

    .venv/bin/python -m eval.bench_sampler [--sizes 4096 32768] [--repeats 50]

Both samplers see the same loss masks (80% supervised, position 0 unsupervised,
one document) and K = 8, r = 0.7, r_min = 0.2; the runs interleave so machine
noise hits both alike. Reported: median wall time per call and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib.metadata import version

import torch
from speculators.models.peagle.data import generate_cod_sample_indices as upstream

from eval.measure import cpu_model
from speculators_peagle_plugin import generate_cod_sample_indices as ours


def _time(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, speculators {version('speculators')}, "
        f"{cpu_model()}, {args.threads} threads"
    )
    print("| n | K | speculators (ms) | ours (ms) | ours with 8 documents (ms) | speedup |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        gen = torch.Generator().manual_seed(n)
        loss_mask = (torch.rand(1, n, generator=gen) < 0.8).long()
        loss_mask[0, 0] = 0
        docs = torch.arange(8).repeat_interleave(n // 8)
        docs = torch.cat([docs, torch.full((n - docs.shape[0],), -1)])
        theirs_t, ours_t, docs_t = [], [], []
        for _ in range(3):  # warm-up
            upstream(n, loss_mask, 8, 0.7, 0.2)
            ours(n, loss_mask, 8, 0.7, 0.2)
        for _ in range(args.repeats):
            theirs_t.append(_time(upstream, n, loss_mask, 8, 0.7, 0.2))
            ours_t.append(_time(ours, n, loss_mask, 8, 0.7, 0.2))
            docs_t.append(_time(ours, n, loss_mask, 8, 0.7, 0.2, document_ids=docs))
        t, o, od = (statistics.median(x) * 1e3 for x in (theirs_t, ours_t, docs_t))
        print(f"| {n} | 8 | {t:.2f} | {o:.2f} | {od:.2f} | {t / o:.2f}x |")


if __name__ == "__main__":
    main()
