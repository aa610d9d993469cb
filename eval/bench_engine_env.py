"""Benchmark: the demo's eval under vLLM-CPU environment settings (core binding, AOT cache).

Usage (after ``make demo``; the machine alone)::

    .venv/bin/python -m eval.bench_engine_env [--demo-dir runs/demo] [--out runs/bench-engine-env]
        [--arm NAME=VAR=VALUE[,VAR=VALUE...]]... [--repeats 3] [--prompts "humaneval[120:164]"]
        [--concurrency 1,16] [--prompts-per-slot 2]

Each arm runs the same ``speculators-peagle eval`` of the demo's trained draft (its target,
dtype, K, KV cache and eval length; no draft and the draft at K, each concurrency) in a fresh
process with its variables set, so every engine starts under them. The arms alternate, one of
each per repeat, so that a drift of the machine touches all alike. The default arms:

- ``auto``: vLLM-CPU's own settings: ``VLLM_CPU_OMP_THREADS_BIND=auto``, which on a machine
  of one NUMA node binds the engine's threads to all its cores but the last, kept for the
  engine's scheduler, and ``VLLM_USE_AOT_COMPILE=1``, its AOT compile cache;
- ``all cores``: ``VLLM_CPU_OMP_THREADS_BIND`` names every core this process may use;
- ``no AOT``: ``VLLM_USE_AOT_COMPILE=0`` (vLLM's older compile cache), binding ``auto``;
- ``ours``: nothing set, so both as the package's engines set them unset on a small machine
  (``engine_start.cpu_engine_env``).

Per arm and repeat (a cell): the command's wall time, each engine's start, the tokens/s of
no draft and of the draft, and the speedup, per concurrency. The table gives each arm's mean
and its spread over the repeats; ``OUT/bench_engine_env.json`` holds the provenance and every
cell. A cell already in the JSON is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eval.demo_run import demo_inputs
from speculators_peagle_plugin.common.files import atomic_write_json
from speculators_peagle_plugin.demo.artifacts import RunLayout
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.evaluation.report import provenance
from speculators_peagle_plugin.options import config_argv

RECORD = "bench_engine_env.json"


def default_arms() -> dict[str, dict[str, str]]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return {
        "auto": {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_USE_AOT_COMPILE": "1"},
        "all cores": {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
                      "VLLM_USE_AOT_COMPILE": "1"},
        "no AOT": {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_USE_AOT_COMPILE": "0"},
        "ours": {},
    }


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=VAR=VALUE[,VAR=VALUE...]`` (``NAME=`` alone: no variable set)."""
    name, _, rest = text.partition("=")
    pairs = [p for p in rest.split(",") if p] if rest else []
    if not name or any("=" not in p for p in pairs):
        raise SystemExit(f"--arm {text!r}: expected NAME=VAR=VALUE[,VAR=VALUE...] or NAME=.")
    return name, dict(p.split("=", 1) for p in pairs)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--out", type=Path, default=Path("runs/bench-engine-env"))
    parser.add_argument("--arm", action="append", default=[], help="NAME=VAR=VALUE[,...]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", default="humaneval[120:164]")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--prompts-per-slot", type=int, default=2)
    return parser.parse_args(argv)


def eval_args(demo: dict, args: argparse.Namespace, out: Path) -> list[str]:
    """The demo's eval of its trained draft, at the chosen prompts and concurrencies."""
    return config_argv(EvalConfig, {
        "target": demo["target"], "drafts": (str(RunLayout(args.demo_dir).trained_draft),),
        "ks": (demo["k"],), "max_new_tokens": demo["eval_max_new_tokens"],
        "concurrency": tuple(int(c) for c in args.concurrency.split(",")),
        "prompts_per_slot": args.prompts_per_slot, "kv_cache_gb": demo["kv_cache_gb"],
        "dtype": demo["dtype"], "output_dir": str(out), "prompt_sets": (args.prompts,),
    })


def cell_of(record: dict, wall_s: float) -> dict:
    """A cell from an eval record: per concurrency, no draft's and the draft's tokens/s."""
    runs = record["runs"]
    cell = {"wall_s": wall_s, "start_s": [r["engine"]["start_s"] for r in runs
                                          if r.get("engine") and r["engine"].get("start_s")]}
    for c in sorted({r["concurrency"] for r in runs}):
        plain = next(r for r in runs if r["concurrency"] == c and r["k"] == 0)
        drafted = next(r for r in runs if r["concurrency"] == c and r["k"] > 0)
        cell[f"c{c}"] = {"plain_tok_s": plain["tokens_per_s"],
                         "draft_tok_s": drafted["tokens_per_s"],
                         "speedup": drafted["tokens_per_s"] / plain["tokens_per_s"],
                         "acceptance_length": drafted["acceptance_length"]}
    return cell


def run_cell(argv: list[str], env: dict[str, str], out: Path) -> dict:
    """One eval from scratch (a cell an interrupted run left is not resumed: its time is
    void)."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "speculators_peagle_plugin", "eval", *argv],
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    if done.returncode != 0:
        raise SystemExit(f"the eval under {env} failed with exit code {done.returncode}.")
    return cell_of(json.loads((out / "record.json").read_text()),
                   time.perf_counter() - started)


def _spread(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return format(mean, fmt)
    return f"{mean:{fmt}} +- {statistics.stdev(values):{fmt}}"


def table(arms: dict, cells: dict) -> str:
    concurrencies = sorted({k for cs in cells.values() for c in cs for k in c if k[0] == "c"
                            and k[1:].isdigit()}, key=lambda k: int(k[1:]))
    head = ["arm", "repeats", "eval wall (s)", "engine start (s)"]
    for c in concurrencies:
        head += [f"no draft tok/s @{c[1:]}", f"speedup @{c[1:]}"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name in arms:
        mine = cells.get(name, [])
        if not mine:
            continue
        row = [name, str(len(mine)), _spread([c["wall_s"] for c in mine], ".0f"),
               _spread([statistics.fmean(c["start_s"]) for c in mine if c["start_s"]], ".0f")]
        for c in concurrencies:
            row += [_spread([m[c]["plain_tok_s"] for m in mine], ".1f"),
                    _spread([m[c]["speedup"] for m in mine], ".2f") + "x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _parse_args(argv)
    demo = demo_inputs(args.demo_dir)
    arms = dict(parse_arm(a) for a in args.arm) if args.arm else default_arms()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / RECORD
    record = json.loads(path.read_text()) if path.is_file() else {}
    cells = record.get("cells", {})
    for i in range(args.repeats):
        for name, env in arms.items():
            if len(cells.get(name, [])) > i:
                continue
            out = args.out / f"{name.replace(' ', '-')}-{i}"
            print(f"[{name}, repeat {i + 1}/{args.repeats}] {env or 'no variables'}",
                  file=sys.stderr, flush=True)
            cells.setdefault(name, []).append(run_cell(eval_args(demo, args, out), env, out))
            atomic_write_json(path, {"provenance": provenance(), "demo_dir": str(args.demo_dir),
                                     "arms": arms, "prompts": args.prompts,
                                     "concurrency": args.concurrency, "cells": cells})
    print(table(arms, cells))


if __name__ == "__main__":
    main()
