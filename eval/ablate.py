"""Recipe ablations: variants of the training recipe on the same data, steps and seeds.

Usage (after ``make demo``, whose target, training data and YAML every arm shares)::

    .venv/bin/python -m eval.ablate --variant baseline --variant hard50 hard_label_weight=0.5
        [--seeds 0,1,2] [--steps N] [--demo-dir runs/demo] [--out runs/ablate]
        [--eval-prompts SPEC ...] [--heldout SPEC ...] [--no-serve] [--lanes N]

A variant is a name and ``field=value`` overrides of ``speculators-peagle train``'s settings
(values in YAML: ``num_depths=6``, ``max_anchors=null``); the first variant is the baseline
the others are set beside. Every arm trains on the demo's data with the demo's YAML for the
same optimizer steps, unless the variant sets ``max_steps`` (the lever "more epochs"; its
training time is in the table) or ``data_path`` (a data-stage A/B: the same prompts with
other replies, e.g. sampled at another temperature); the seed sets the initial weights, the
row order and the COD draws. ``--steps N`` trains every arm exactly N steps, a ``data_path``
arm too (its epochs raised to reach them), unless the variant sets ``epochs`` itself.
Per variant and seed (a cell):

- train: ``speculators-peagle train`` in a child process; its wall time and peak RSS;
- held out: teacher-forced loss, accuracy per depth and the acceptance estimate
  (:func:`~speculators_peagle_plugin.training.heldout.heldout_metrics`) on the target's
  greedy replies to each ``--heldout`` prompt set (generated once, under ``OUT/heldout/``);
- served: ``speculators-peagle eval`` at the demo's K, greedy, on the ``--eval-prompts``
  sets: acceptance length, mean and per position (``--no-serve`` screens on the held-out
  figures alone; a later run without it serves the screened drafts).

``--lanes N`` runs N cells at once, each lane a process on its share of the cores (its
training's threads, its eval engine's binding: ``common.devices.cpu_shares``), its output in
``OUT/lanes/lane-<k>.log``: on a small CPU, one training on every core leaves them idle for
part of each step (``python -m eval.bench_lanes`` measures both).
A cell's figures go to ``OUT/<variant>/seed-<s>/cell.json`` when it ends; a rerun skips the
finished cells and resumes an interrupted training. ``OUT/ablation.json`` holds every cell
and, per variant and figure, the mean and the sample standard deviation over the seeds. The
table sets each variant beside the baseline: the difference of the means, marked ``*``
where it exceeds twice the larger of the two standard deviations (the bar a default must
clear on both HumanEval and MT-Bench before it is adopted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eval.demo_run import REPO, demo_inputs, run_command, served_acceptance
from speculators_peagle_plugin.common.devices import (
    cpu_has_bfloat16,
    cpu_shares,
    cpu_train_settings,
    start_on_cores,
    usable_cores,
)
from speculators_peagle_plugin.common.files import atomic_write_text
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.evaluation.report import provenance
from speculators_peagle_plugin.options import config_argv, file_with
from speculators_peagle_plugin.training.train_config import TrainConfig


def parse_variant(tokens: list[str]) -> tuple[str, dict]:
    """``["hard50", "hard_label_weight=0.5"]`` -> ``("hard50", {"hard_label_weight": 0.5})``."""
    from speculators_peagle_plugin.common.settings import leaves
    from speculators_peagle_plugin.training.train_config import TrainConfig

    name, overrides = tokens[0], {}
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"variant name {name!r} must be letters, digits, '_', '.' or '-'.")
    known = {leaf.key for leaf in leaves(TrainConfig)}
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in known:
            raise SystemExit(
                f"variant {name}: {token!r} is not FIELD=VALUE with a train setting as FIELD."
            )
        overrides[key] = yaml.safe_load(value)
    return name, overrides


def _variant_yaml(demo: dict, overrides: dict, path: Path) -> Path:
    """The demo's YAML with the variant's overrides (bfloat16 autocast only where native,
    as the demo trains)."""
    settings = file_with(TrainConfig, yaml.safe_load(Path(demo["config"]).read_text()),
                         {**cpu_train_settings(cpu_has_bfloat16()), **overrides})
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(settings, sort_keys=False))
    return path


def _heldout_data(demo: dict, spec: str, out: Path) -> Path:
    """The target's greedy replies (and hidden states) to ``spec``, generated once."""
    path = out / "heldout" / re.sub(r"[^A-Za-z0-9_.-]+", "_", spec).strip("_")
    if not (path / "state.json").is_file():
        args = config_argv(DataGenConfig, {
            "target": demo["target"], "prompts": spec, "output": str(path),
            "max_new_tokens": demo["max_new_tokens"], "backend": "vllm",
            "kv_cache_gb": demo["kv_cache_gb"],
            # the held-out sets themselves: scored, never trained on
            "contamination_guard": False, "dtype": demo["dtype"],
        })
        run_command([sys.executable, "-m", "speculators_peagle_plugin", "generate-data", *args])
    return path


def train_command(
    demo: dict, config_yaml: Path, data: str, save: Path, seed: int, steps: int | None
) -> list[str]:
    """``speculators-peagle train`` of ``config_yaml`` on ``data`` into ``save``, with the
    demo's target and CPU precision, ``seed`` and ``steps`` (the YAML's where None)."""
    values = {"verifier_name_or_path": demo["target"], "data_path": data,
              "save_path": str(save), "seed": seed}
    if steps is not None:
        values["max_steps"] = steps
    values.update(cpu_train_settings(demo["native_bf16"]))
    return [sys.executable, "-m", "speculators_peagle_plugin", "train",
            *config_argv(TrainConfig, values, config_file=config_yaml)]


def _train(
    demo: dict, config_yaml: Path, data: str, save: Path, seed: int, steps: int | None
) -> dict:
    """Train one cell in a child process (its progress bar on the terminal); its wall time,
    peak RSS and final checkpoint."""
    import time

    from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs
    from speculators_peagle_plugin.training.progress import METRICS_FILE

    cmd = train_command(demo, config_yaml, data, save, seed, steps)
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"training {save} failed (output above); rerun to resume it.")
    records = [json.loads(line) for line in (save / METRICS_FILE).read_text().splitlines()]
    return {
        "checkpoint": str(checkpoint_dirs(save)[-1]),
        "train_s": time.perf_counter() - began,
        "peak_rss_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
        "steps": records[-1]["step"],
        "final_loss": records[-1]["loss"],
    }


def demo_trained_it(demo: dict, overrides: dict, seed: int, steps: int | None) -> bool:
    """Whether the demo trained this arm already: its own recipe, seed and steps on the same
    data (training is deterministic, so its checkpoint is the arm's)."""
    trained = demo["trained"]
    same_run = trained is not None and seed == trained["seed"] and steps == demo["steps_demo"]
    return not overrides and same_run


def _cell_dir(out: str, name: str, seed: int) -> Path:
    return Path(out) / name / f"seed-{seed}"


def run_cell(demo: dict, args, variant: tuple[str, dict], seed: int, heldout: dict) -> dict:
    """One variant at one seed: train, held-out figures, served figures (``cell.json``)."""
    from speculators_peagle_plugin.training.heldout import heldout_metrics
    from speculators_peagle_plugin.training.train_config import TrainConfig

    name, overrides = variant
    cell_dir = _cell_dir(args.out, name, seed)
    done = cell_dir / "cell.json"
    if done.is_file():
        cell = json.loads(done.read_text())
        if cell["overrides"] != overrides:
            raise SystemExit(f"{cell_dir} was made with other overrides; use another --out.")
        if cell["served"] or not args.serve:
            return cell
        return _served(demo, args, cell, cell_dir)  # screened before: serve it now
    # every arm trains the same steps, unless the variant is about the step count
    steps = args.steps if args.steps is not None else demo["steps_demo"]
    steps = overrides.get("max_steps", steps)
    # --steps N is N steps exactly: max_steps only caps epochs, and an arm whose data packs
    # into fewer rows would end its epochs sooner (an epoch is at least one step)
    exact = {"epochs": steps} if args.steps is not None else {}
    config_yaml = _variant_yaml(demo, {**exact, **overrides}, Path(args.out) / name / "train.yaml")
    data = str(Path(overrides.get("data_path", demo["data"])).resolve())
    if demo_trained_it(demo, overrides, seed, steps):
        trained = {**demo["trained"], "peak_rss_gib": None}  # no peak RSS on record
    else:
        trained = _train(demo, config_yaml, data, cell_dir / "train", seed, steps)
    config = TrainConfig.from_sources(
        str(config_yaml), verifier_name_or_path=demo["target"], data_path=data,
        save_path=str(cell_dir / "train"), seed=seed,
    )
    cell = {
        "variant": name,
        "overrides": overrides,
        "seed": seed,
        **trained,
        "heldout": {
            spec: heldout_metrics(trained["checkpoint"], config, path)
            for spec, path in heldout.items()
        },
        "served": {},
    }
    if args.serve:
        return _served(demo, args, cell, cell_dir)
    atomic_write_text(done, json.dumps(cell, indent=1) + "\n")
    return cell


def _served(demo: dict, args, cell: dict, cell_dir: Path) -> dict:
    """The cell with its draft's served figures, written to ``cell.json``."""
    checkpoint = cell["checkpoint"]
    served = served_acceptance(demo, [checkpoint], args.eval_prompts, cell_dir / "eval")
    cell = {**cell, "served": served[checkpoint]}
    atomic_write_text(cell_dir / "cell.json", json.dumps(cell, indent=1) + "\n")
    return cell


def figures(cell: dict) -> dict[str, float]:
    """The figures compared across variants, by a name that says where they come from."""
    out = {}
    for spec, served in cell["served"].items():
        out[f"served {spec}: acceptance length"] = served["acceptance_length"]
        for i, rate in enumerate(served["per_position"] or []):
            out[f"served {spec}: position {i + 1}"] = rate
    for spec, held in cell["heldout"].items():
        out[f"held out {spec}: acceptance estimate"] = held["acceptance_length"]
        for d, acc in enumerate(held["accuracy_per_depth"]):
            out[f"held out {spec}: accuracy depth {d}"] = acc
    out["train s"] = cell["train_s"]
    if cell["peak_rss_gib"] is not None:
        out["peak RSS GiB"] = cell["peak_rss_gib"]
    return out


def summarise(cells: list[dict], variants: list[str]) -> dict:
    """Per variant and figure: mean, sample standard deviation and count over seeds."""
    summary = {}
    for name in variants:
        rows = [figures(c) for c in cells if c["variant"] == name]
        keys = [k for k in rows[0] if all(k in r for r in rows)]
        summary[name] = {
            k: {
                "mean": statistics.fmean(r[k] for r in rows),
                "std": statistics.stdev(r[k] for r in rows) if len(rows) > 1 else 0.0,
                "n": len(rows),
            }
            for k in keys
        }
    return summary


def table(summary: dict, variants: list[str]) -> str:
    """Markdown: a row per figure, a column per variant; ``Δ`` against the first variant,
    ``*`` where it exceeds twice the larger standard deviation of the two."""
    base = summary[variants[0]]
    lines = ["| figure | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    for key in base:
        cells = []
        for name in variants:
            s = summary[name].get(key)
            if s is None:
                cells.append("-")
                continue
            text = f"{s['mean']:.3f} ± {s['std']:.3f}"
            if name != variants[0]:
                delta = s["mean"] - base[key]["mean"]
                clears = abs(delta) > 2 * max(s["std"], base[key]["std"]) and s["n"] > 1
                text += f" (Δ {delta:+.3f}{'*' if clears else ''})"
            cells.append(text)
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variant", action="append", nargs="+", metavar="NAME [FIELD=VALUE]",
        help="Repeatable; the first is the baseline [default: baseline].",
    )
    parser.add_argument("--seeds", default="0,1,2", help="Comma-separated [default: 0,1,2].")
    parser.add_argument("--steps", type=int, help="Optimizer steps [default: the demo's].")
    parser.add_argument("--demo-dir", default="runs/demo")
    parser.add_argument("--out", default="runs/ablate")
    parser.add_argument("--eval-prompts", action="append", help="[default: the demo's].")
    parser.add_argument("--heldout", action="append", help="[default: the demo's eval sets].")
    parser.add_argument(
        "--no-serve", dest="serve", action="store_false",
        help="Screen: train and score held out only, no vLLM. A later run without this flag "
        "serves the screened cells' drafts without training them again.",
    )
    parser.add_argument(
        "--lanes", type=int, default=1,
        help="Cells run at once, each on its share of the cores [default: 1].",
    )
    parser.add_argument("--lane", help=argparse.SUPPRESS)  # K/N: this process runs cells K::N
    return parser.parse_args()


def _finished(args, jobs: list) -> int:
    """How many of ``jobs`` (seed, variant) have a ``cell.json`` that needs nothing more."""
    count = 0
    for seed, (name, _) in jobs:
        done = _cell_dir(args.out, name, seed) / "cell.json"
        if done.is_file() and (json.loads(done.read_text())["served"] or not args.serve):
            count += 1
    return count


def run_lanes(args, jobs: list) -> None:
    """Run ``jobs`` (seed, variant) in ``args.lanes`` processes at once: lane ``k`` is this
    command with ``--lane k/N`` (the cells ``k::N``) on its :func:`cpu_shares` share, its
    output in ``OUT/lanes/lane-<k>.log``; a bar counts the finished cells. Exits naming each
    lane that failed; a rerun resumes every cell."""
    from tqdm import tqdm

    logs = Path(args.out) / "lanes"
    logs.mkdir(parents=True, exist_ok=True)
    running = []
    try:
        for k, (variables, mine) in enumerate(cpu_shares(args.lanes)):
            log = logs / f"lane-{k}.log"
            cmd = [sys.executable, "-m", "eval.ablate", *sys.argv[1:], "--lane",
                   f"{k}/{args.lanes}"]
            running.append((log, start_on_cores(cmd, {**os.environ, **variables}, mine, log)))
            print(f"lane {k}: cores {mine}, log {log}", file=sys.stderr, flush=True)
        with tqdm(total=len(jobs), initial=_finished(args, jobs), unit="cell") as bar:
            while any(process.poll() is None for _, process in running):
                time.sleep(5)
                bar.update(_finished(args, jobs) - bar.n)
    finally:
        for _, process in running:
            if process.poll() is None:
                process.terminate()
                process.wait()
    failed = [f"lane {k} (exit {process.returncode}, log {log})"
              for k, (log, process) in enumerate(running) if process.returncode != 0]
    if failed:
        raise SystemExit(f"{', '.join(failed)} failed; rerun the same command to resume.")


def main() -> None:
    args = _parse_args()
    variants = [parse_variant(v) for v in (args.variant or [["baseline"]])]
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must differ, got {names}.")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(
            f"--seeds {args.seeds!r} is not a comma-separated list of integers."
        ) from None
    cores = len(usable_cores())
    if args.lane is None and not 1 <= args.lanes <= cores:  # a lane has its share of them
        raise SystemExit(f"--lanes {args.lanes}: a lane needs a core of its own and this "
                         f"machine has {cores}; use 1 to {cores}.")
    demo = demo_inputs(Path(args.demo_dir))
    args.out = str(Path(args.out).resolve())
    args.eval_prompts = args.eval_prompts or demo["eval_prompts"]
    heldout = {spec: _heldout_data(demo, spec, Path(args.out))
               for spec in args.heldout or demo["eval_prompts"]}
    # seed-major: an interrupted run has every variant at its first seeds
    jobs = [(seed, variant) for seed in seeds for variant in variants]
    if args.lane is not None:  # one of run_lanes' processes: its cells; the parent sums up
        k, _, n = args.lane.partition("/")
        for seed, variant in jobs[int(k)::int(n)]:
            run_cell(demo, args, variant, seed, heldout)
        return
    if args.lanes != 1:
        run_lanes(args, jobs)
    cells = []
    for i, (seed, variant) in enumerate(jobs):
        print(f"[cell {i + 1}/{len(jobs)}] {variant[0]} seed {seed}", file=sys.stderr,
              flush=True)
        cells.append(run_cell(demo, args, variant, seed, heldout))
    summary = summarise(cells, names)
    record = {
        "provenance": provenance(["python", "-m", "eval.ablate", *sys.argv[1:]]),
        "demo": demo,
        "variants": dict(variants),
        "seeds": seeds,
        "steps": args.steps,
        "cells": cells,
        "summary": summary,
    }
    atomic_write_text(Path(args.out) / "ablation.json", json.dumps(record, indent=1) + "\n")
    print(table(summary, names))
    print(f"\nrecord: {Path(args.out) / 'ablation.json'}")


if __name__ == "__main__":
    main()
