"""Benchmark: one P-EAGLE training step, speculators 0.9.0's draft vs this plugin's, on CPU.

    .venv/bin/python -m eval.bench_train_step [--seq-lens 1024 2048 4096 8192] [--steps 3]
        [--warmup 2] [--partition-curve-seq-len 8192 --partitions 1 2 4 8]
        [--long-seq-len 16384 --long-partitions 8] [--skip-speculators] [--json OUT]

One step is ``opt.zero_grad(set_to_none=True)`` -> forward -> backward ->
``torch.optim.AdamW(lr=1e-3, weight_decay=0.01).step()``, float32, 2 threads
(``OMP_WAIT_POLICY=PASSIVE`` unless set: see ``run_case``):

- speculators: ``speculators.models.peagle.core.PEagleDraftModel`` called directly
  (its Trainer is GPU-only): eager KL loss, draft attention ``sdpa``, no ``max_anchors``.
- ours: ``speculators_peagle_plugin.model.peagle_draft.PEagleDraftModel`` built from the same
  ``PEagleSpeculatorConfig``, trained through ``PEagleTrainerModule.forward_batch``;
  with ``P > 1`` sequence partitions, one backward per plan segment.

Both drafts: 1 llama layer, sliding window 2048, target layers [2, 15, 27], trainable
embeddings, draft vocab 8192 with random valid t2d/d2t, K = 8, r = 0.7, r_min = 0.2,
a SmolLM2-135M-shaped verifier (config only, in a temporary directory, no download).
Both see the same packed batch (one document, loss mask all ones but position 0) and
the same torch seed per step, so both COD samplers draw the same elements.

Each (side, S, P) case runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is
its own. Reported: median step seconds over the timed steps, peak RSS, the flat
COD element count N of the last step, and the 1-min load average after each case
(the machine may be shared: other processes skew step times, not peak memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from eval.measure import cpu_model
from eval.train_step_case import (
    DRAFT_VOCAB,
    LR,
    NUM_LAYERS,
    R_MIN,
    SLIDING_WINDOW,
    WEIGHT_DECAY,
    K,
    R,
    worker,
)
from speculators_peagle_plugin.common.files import atomic_write_json

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- #
# driver: one subprocess per case, markdown tables
# --------------------------------------------------------------------------- #
def run_case(case: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(case["threads"]))
    env.setdefault("MKL_NUM_THREADS", str(case["threads"]))
    # On a shared machine, OpenMP's default spin-waiting lets an idle worker thread hold
    # the core its busy sibling needs, and a case with many parallel regions then loses
    # most of its time to it. Waiting passively makes each side's step time follow the
    # CPU it actually gets. Same setting for both sides.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("PYTHONWARNINGS", "ignore")
    cmd = [sys.executable, "-m", "eval.bench_train_step", "--worker", json.dumps(case)]
    print(f"== {case['side']} S={case['S']} P={case['P']}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    try:
        p = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return dict(case, error=f"timeout after {timeout:.0f}s", wall_s=time.perf_counter() - t)
    wall = time.perf_counter() - t
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        why = "killed (SIGKILL: OOM killer?)" if p.returncode == -9 else f"rc={p.returncode}"
        return dict(case, error=f"worker died: {why}", wall_s=wall)
    res = json.loads(lines[-1][len("RESULT ") :])
    res["wall_s"] = wall
    return res


def _s(r: dict) -> str:
    if r.get("error"):
        return f"error: {r['error']}"
    x = r.get("median_s")
    if x is None:
        return f"— ({r.get('aborted', 'no timed step')})"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _gib(r: dict) -> str:
    x = r.get("peak_rss_gib")
    return "—" if x is None else f"{x:.2f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--partition-curve-seq-len", type=int, default=8192)
    parser.add_argument("--partitions", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--long-seq-len", type=int, default=16384, help="0 = skip")
    parser.add_argument("--long-partitions", type=int, default=8)
    parser.add_argument("--skip-speculators", action="store_true", help="run only our side")
    parser.add_argument("--json", type=str, default=None, help="also write all results here")
    parser.add_argument(
        "--step-limit-s", type=float, default=600.0, help="stop a case after a slower step"
    )
    parser.add_argument("--case-timeout-s", type=float, default=3600.0)
    parser.add_argument(
        "--mem-cap-gb", type=float, default=22.0, help="RLIMIT_AS per worker (0 = none)"
    )
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def _run_cases(args) -> tuple[list, list, dict | None, dict]:
    """Every case the arguments ask for, each once: ``(main_rows, curve_rows, long_row,
    every result by (side, S, P))``."""
    shared = ("steps", "warmup", "threads", "step_limit_s", "mem_cap_gb")
    common = {name: getattr(args, name) for name in shared}
    cache: dict[tuple, dict] = {}

    def case(side: str, S: int, P: int) -> dict:
        if (side, S, P) not in cache:  # e.g. ours S=8192 P=1 serves two tables
            cache[side, S, P] = run_case(dict(common, side=side, S=S, P=P), args.case_timeout_s)
        return cache[side, S, P]

    main_rows = []
    for S in args.seq_lens:
        theirs = None if args.skip_speculators else case("speculators", S, 1)
        main_rows.append((S, theirs, case("ours", S, 1)))
    curve_S = args.partition_curve_seq_len
    curve_rows = [(P, case("ours", curve_S, P)) for P in args.partitions] if curve_S else []
    long_row = case("ours", args.long_seq_len, args.long_partitions) if args.long_seq_len else None
    return main_rows, curve_rows, long_row, cache


def _print_comparison(main_rows: list) -> None:
    """Step time, peak memory and CPU seconds: speculators vs ours, per sequence length."""
    print(
        "| S | speculators step (s) | ours step (s) | speedup | "
        "speculators peak (GiB) | ours peak (GiB) | memory ratio | COD N |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for S, theirs, ours in main_rows:
        theirs = theirs or {}
        n = ours.get("cod_N") or theirs.get("cod_N") or "—"
        if theirs.get("cod_N") and ours.get("cod_N") and theirs["cod_N"] != ours["cod_N"]:
            n = f"{theirs['cod_N']} / {ours['cod_N']}"
        print(
            f"| {S} | {_s(theirs) if theirs else 'skipped'} | {_s(ours)} | "
            f"{_ratio(theirs.get('median_s'), ours.get('median_s'))} | "
            f"{_gib(theirs) if theirs else 'skipped'} | {_gib(ours)} | "
            f"{_ratio(theirs.get('peak_rss_gib'), ours.get('peak_rss_gib'))} | {n} |"
        )
    print()
    print("Process CPU seconds per step, all threads (median; robust to other load at 1 thread)")
    print()
    print("| S | speculators CPU (s) | ours CPU (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for S, theirs, ours in main_rows:
        theirs_cpu, ours_cpu = (theirs or {}).get("median_cpu_s"), ours.get("median_cpu_s")
        print(
            f"| {S} | {'—' if theirs_cpu is None else f'{theirs_cpu:.2f}'} | "
            f"{'—' if ours_cpu is None else f'{ours_cpu:.2f}'} | {_ratio(theirs_cpu, ours_cpu)} |"
        )


def _print_ours(args, curve_rows: list, long_row: dict | None) -> None:
    """Ours alone: the partition curve at one length, and the long-context case."""
    if curve_rows:
        print()
        S = args.partition_curve_seq_len
        print(f"Ours, S={S}: step time and memory vs sequence partitions")
        print()
        print("| partitions | ours step (s) | ours peak (GiB) |")
        print("|---:|---:|---:|")
        for P, r in curve_rows:
            print(f"| {P} | {_s(r)} | {_gib(r)} |")
    if long_row:
        print()
        print("Ours, long context")
        print()
        print("| S | partitions | ours step (s) | ours peak (GiB) |")
        print("|---:|---:|---:|---:|")
        print(
            f"| {args.long_seq_len} | {args.long_partitions} | {_s(long_row)} | {_gib(long_row)} |"
        )


def main() -> None:
    args = _parse_args()
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    t_all = time.perf_counter()
    main_rows, curve_rows, long_row, cache = _run_cases(args)
    print(
        f"torch {version('torch')}, transformers {version('transformers')}, "
        f"speculators {version('speculators')}, python {platform.python_version()}, "
        f"{cpu_model()}, {args.threads} threads, "
        f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
    )
    print(
        f"float32, K={K} r={R} r_min={R_MIN}, draft vocab {DRAFT_VOCAB}, {NUM_LAYERS} layer, "
        f"sliding window {SLIDING_WINDOW}, AdamW lr={LR} wd={WEIGHT_DECAY}, "
        f"{args.warmup} warm-up + {args.steps} timed steps (median), "
        f"total wall {time.perf_counter() - t_all:.0f}s"
    )
    print()
    _print_comparison(main_rows)
    _print_ours(args, curve_rows, long_row)
    loads = [
        f"{r['side']} S={r['S']} P={r['P']}: {r['load_avg_1min']:.1f}"
        for r in cache.values()
        if r.get("load_avg_1min") is not None
    ]
    print()
    print(f"1-min load average after each case ({os.cpu_count()} CPUs): " + "; ".join(loads))
    if args.json:
        results = dict(
            main=[dict(S=S, speculators=t, ours=o) for S, t, o in main_rows],
            partitions=[dict(P=P, ours=r) for P, r in curve_rows],
            long=long_row,
        )
        atomic_write_json(Path(args.json), results, indent=1)


if __name__ == "__main__":
    main()
