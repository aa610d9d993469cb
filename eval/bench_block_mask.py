"""Benchmark: time and memory of the flex BlockMask build, torch's create_block_mask (eager,
and compiled by Inductor) against this plugin's build from the COD layout.

    .venv/bin/python -m eval.bench_block_mask [--lengths 8192 16384 32768 65536 131072]

Per row length: one packed row of that many tokens (4 documents, padding, 8 COD depths:
the selftest's random rows), no window, and for ours also a 2,048-token window. Each build
runs in a fresh process with one thread, which reports its peak RSS growth over the build
(``ru_maxrss`` after minus before) and its time; a build that passes ``--limit-s`` or
``--limit-gib`` (its address space is capped) is shown as ``-``. All builds give the same
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

BUILDS = ("create_block_mask", "create_block_mask compiled", "COD layout (ours)",
          "COD layout, window 2048 (ours)")


def _one(build: str, length: int) -> dict:
    """Build the mask of one row here (in a fresh process) and report it."""
    from torch.nn.attention.flex_attention import create_block_mask

    from speculators_peagle_plugin.kernels.attention import PEagleMask
    from speculators_peagle_plugin.kernels.cod_block_mask import cod_block_mask
    from speculators_peagle_plugin.selftest.rows import random_cod_elements

    window = 2048 if "window" in build else None
    compiled = torch.compile(create_block_mask, dynamic=True)
    anchor, depth, doc = random_cod_elements(0, length=length, num_depths=8)
    mask_mod, n = PEagleMask(anchor, depth, doc, window, "flex").mask_mod, anchor.numel()
    build_fn = {
        "create_block_mask": lambda: create_block_mask(mask_mod, None, None, n, n, "cpu"),
        "create_block_mask compiled": lambda: compiled(mask_mod, None, None, n, n, "cpu"),
    }.get(build, lambda: cod_block_mask(anchor, depth, doc, window, mask_mod=mask_mod,
                                        full_width=False))
    if build == "create_block_mask compiled":  # compile once on a short row, time the next
        small_anchor, small_depth, small_doc = random_cod_elements(1, length=512, num_depths=8)
        small = PEagleMask(small_anchor, small_depth, small_doc, None, "flex")
        compiled(small.mask_mod, None, None, small_anchor.numel(), small_anchor.numel(), "cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    mask = build_fn()
    seconds = time.perf_counter() - began
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    blocks = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    return {"elements": n, "peak_growth_gib": grown / 2**20, "seconds": seconds,
            "blocks": blocks}


def _run_child(build: str, length: int, limit_s: float, limit_gib: float) -> dict | None:
    child = [sys.executable, "-m", "eval.bench_block_mask", "--one", build, str(length)]
    cap = int(limit_gib * 2**30)

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    try:
        done = subprocess.run(child, capture_output=True, text=True, timeout=limit_s,
                              env={**os.environ, "OMP_NUM_THREADS": "1"},
                              preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--limit-s", type=float, default=300.0)
    parser.add_argument("--limit-gib", type=float, default=16.0)
    parser.add_argument("--one", nargs=2, metavar=("BUILD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child process
        print(json.dumps(_one(args.one[0], int(args.one[1]))))
        return
    print(f"torch {torch.__version__}, {cpu_model()}, one thread; limits {args.limit_s:.0f} s, "
          f"{args.limit_gib:.0f} GiB of address space")
    print("| tokens | elements | build | peak RSS growth (GiB) | seconds | non-empty blocks |")
    print("|---:|---:|---|---:|---:|---:|")
    from speculators_peagle_plugin.selftest.rows import random_cod_elements

    for length in args.lengths:
        elements = random_cod_elements(0, length=length, num_depths=8)[0].numel()
        for build in BUILDS:
            r = _run_child(build, length, args.limit_s, args.limit_gib)
            if r is None:
                print(f"| {length} | {elements} | {build} | - | - | - |", flush=True)
                continue
            print(f"| {length} | {elements} | {build} | {r['peak_growth_gib']:.3f} | "
                  f"{r['seconds']:.3f} | {r['blocks']} |", flush=True)


if __name__ == "__main__":
    main()
