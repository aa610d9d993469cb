"""Benchmark: the CPU step eager (today's block-sparse attention and fused loss) against the
step compiled as the CUDA region is (training/draft_loss.py), on the CPU.

    .venv/bin/python -m eval.bench_compiled_step [--seq-lens 2048 4096] [--steps 4]

The compiled arm is what Inductor can build on the CPU with torch 2.13: flex attention has
no CPU backward there, so the region's attention is today's block-sparse kernel, left out
of the graph (``torch.compiler.disable``), and everything else (projection, norms, rotary,
MLP, ``lm_head`` and the KL as plain operations) is compiled with ``dynamic=True``; a third
arm leaves today's fused loss out of the graph too. One
float32 step (forward, backward, AdamW) of the selftest's smollm2-shaped draft (one layer,
window 2048) on one packed row; each arm in a fresh process, both threads; the median step
after the first (the first compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from eval.measure import cpu_model

ARMS = ("eager", "compiled", "compiled, fused loss")


def _one(arm: str, seq_len: int, steps: int) -> dict:
    from speculators_peagle_plugin.kernels import attention
    from speculators_peagle_plugin.kernels.fused_kl import fused_linear_kl, linear_kl
    from speculators_peagle_plugin.selftest.perf import make_row
    from speculators_peagle_plugin.selftest.shapes import SHAPES, build_draft, trainer_for
    from speculators_peagle_plugin.training import draft_loss

    shape, device = SHAPES["smollm2"], torch.device("cpu")
    draft = build_draft(shape, device, 0, 2048)
    module = trainer_for(draft, seed=0)
    optimizer = torch.optim.AdamW([p for p in draft.model.parameters() if p.requires_grad])
    if arm != "eager":
        attention._chunked_attention = torch.compiler.disable(attention._chunked_attention)
        compiled = torch.compile(draft_loss.draft_loss, dynamic=True)
        kl = (torch.compiler.disable(fused_linear_kl) if arm.endswith("fused loss")
              else linear_kl)

        def row_loss(draft, ids, aux, context, positions, masks, rows, targets, target_rows,
                     loss):
            return compiled(draft, ids, aux, context, positions, masks, rows, targets,
                            target_rows, loss.hard_label_weight, loss.tv_weight, kl=kl)

        draft_loss.row_loss = row_loss
    batch = make_row(shape, seq_len, device, torch.float32)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        optimizer.zero_grad()
        metrics = module.forward_batch(batch)
        metrics.loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return {"first_s": times[0], "step_s": statistics.median(times[1:]),
            "loss": float(metrics.loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one(args.one[0], int(args.one[1]), args.steps)))
        return
    print(f"torch {torch.__version__}, {cpu_model()}, {torch.get_num_threads()} threads")
    print("| tokens | arm | first step (s) | step (s) | over eager | loss |")
    print("|---:|---|---:|---:|---:|---:|")
    for seq_len in args.seq_lens:
        eager = None
        for arm in ARMS:
            child = [sys.executable, "-m", "eval.bench_compiled_step", "--one", arm,
                     str(seq_len), "--steps", str(args.steps)]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            eager = eager or r["step_s"]
            print(f"| {seq_len} | {arm} | {r['first_s']:.2f} | {r['step_s']:.3f} | "
                  f"{r['step_s'] / eager:.2f}x | {r['loss']:.6f} |", flush=True)


if __name__ == "__main__":
    main()
