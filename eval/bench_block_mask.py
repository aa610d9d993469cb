"""Benchmark: memory of the flex BlockMask build, torch's eager create_block_mask over the
whole mask vs this plugin's slabs of query rows (its CPU path, and its CUDA fallback).

    .venv/bin/python -m eval.bench_block_mask [--lengths 2048 4096]

Per row length: one packed row of that many tokens, 8 COD depths (the selftest's random
rows), no window; each build in a fresh process, which reports its peak RSS growth over
the build (``ru_maxrss`` after minus before) and its time. Both builds give the same
``BlockMask`` (tests/test_block_mask.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from eval.measure import cpu_model

BUILDS = ("create_block_mask", "slabs")


def _one(build: str, length: int) -> dict:
    """Build the mask of one row here (in a fresh process) and report it."""
    from torch.nn.attention.flex_attention import create_block_mask

    from speculators_peagle_plugin.kernels import flex
    from speculators_peagle_plugin.kernels.attention import PEagleMask
    from speculators_peagle_plugin.selftest.rows import random_cod_elements

    anchor, depth, doc = random_cod_elements(0, length=length, num_depths=8)
    mask_mod, n = PEagleMask(anchor, depth, doc, None, "flex").mask_mod, anchor.numel()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    if build == "create_block_mask":
        create_block_mask(mask_mod, None, None, n, n, device="cpu")
    else:
        flex.block_mask_by_slabs(mask_mod, n, "cpu")
    seconds = time.perf_counter() - began
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    return {"elements": n, "peak_growth_gib": grown / 2**20, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--one", nargs=2, metavar=("BUILD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child process
        print(json.dumps(_one(args.one[0], int(args.one[1]))))
        return
    print(f"torch {torch.__version__}, {cpu_model()}, one thread")
    print("| tokens | elements | build | peak RSS growth (GiB) | seconds |")
    print("|---:|---:|---|---:|---:|")
    for length in args.lengths:
        for build in BUILDS:
            child = [sys.executable, "-m", "eval.bench_block_mask", "--one", build, str(length)]
            done = subprocess.run(child, capture_output=True, text=True, check=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"| {length} | {r['elements']} | {build} | {r['peak_growth_gib']:.2f} | "
                  f"{r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
