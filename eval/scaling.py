"""The scaling curve: served acceptance against training prompts, optimizer steps and depth.

Usage (after the long recipe,
``speculators-peagle demo --recipe configs/recipes/long_smollm2.yaml``, whose target,
training data and validation data every cell shares)::

    .venv/bin/python -m eval.scaling --run-dir runs/long --prompts 220,1000,4430 \\
        --steps 500,1000,2000,4000 --num-layers 1,2 --seeds 42 [--more-data DIR] \\
        [--config configs/long_smollm2_train.yaml] [--out runs/scaling] [--report eval/scaling]

A cell is N prompts, a draft of L layers and a seed. ``--more-data`` adds prompts beyond the
run's: a generate-data output, made with the run data's settings, of further prompts
(``tools.extend_prompts`` writes those of a larger spec that come after the run's own), read
after the run's rows.

- data: ``OUT/data/prompts-<N>``, the rows of the run's first N training prompts
  (``train_prompts.jsonl``: the demo's 220, then MBPP, then ShareGPT), hidden states
  linked, not copied; ``token_freq.pt`` and ``d2t``/``t2d`` are counted again from those
  rows alone, with the functions generate-data and train use, so the draft vocabulary is
  the one N prompts give (:func:`prefix_data`);
- train: one ``speculators-peagle train`` run of max(steps) optimizer steps with the
  recipe's YAML, fixed steps (no early stop), a checkpoint on every requested step
  (:func:`checkpoint_plan`); the checkpoints between them are deleted when it ends. A
  checkpoint at step S shares the longest run's learning-rate schedule (1 % warmup, then
  linear decay to 0 at max(steps)): it is that run seen at S, not an S-step run of its own,
  whose rate would have decayed to 0 at S;
- points, one per requested step: served acceptance (``speculators-peagle eval``: K 4,
  greedy, 16 requests in flight x 5, that is HumanEval[120:164] and all 80 MT-Bench first
  turns, compiled engines as ``vllm serve`` runs them, in the dtype the run's data was made
  in), and the estimated acceptance on the run's validation data
  (:func:`~speculators_peagle_plugin.training.heldout.heldout_metrics`), so the curve can
  be read from both.

Resumable: a prefix, a finished training run and a finished point are kept
(``OUT/cells/p<N>-l<L>-s<seed>/{plan.json,train/,step-<S>/point.json}``); an interrupted
run resumes from its newest checkpoint, and an eval whose ``record.json`` is there for the
same checkpoint and settings is not run again. A cell trained with other steps or another
YAML is refused. OUT (git-ignored ``runs/scaling`` by default) holds the bulk: prefix data
and checkpoints. ``REPORT/scaling.json`` holds every point under OUT (so a second
invocation, three seeds at the adopted points, adds to the first), ``REPORT/scaling.png``
draws them (REPORT: ``eval/scaling``, beside eval/RESULTS.md), and
the markdown tables (rows prompts x layers, columns steps; mean ± sample std over seeds
where there are several) are printed for eval/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from eval.demo_run import run_command
from eval.scaling_cells import (
    Runner,
    cell_name,
    check_schedule,
    checkpoint_count,
    checkpoint_plan,
    digest,
    echo,
    more_data_inputs,
    prefix_data,
    prompt_of_rows,
    rendered_prompts,
    run_inputs,
    steps_per_epoch,
    train_cell,
    train_yaml,
    trained_until,
)
from eval.scaling_report import EVAL_K, plot, summarise, tables
from speculators_peagle_plugin.common.devices import cpu_has_bfloat16
from speculators_peagle_plugin.common.files import atomic_write_text
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.options import config_argv

# What every point is served with (the long recipe's held-out sets, at its larger K).
EVAL_SETS = ("humaneval[120:164]", "mt_bench")
EVAL_CONCURRENCY = 16
EVAL_PROMPTS_PER_SLOT = 5  # 16 x 5 = all 80 MT-Bench questions and HumanEval's 44
EVAL_MAX_NEW_TOKENS = 128
EVAL_KV_CACHE_GB = 4
POINT_FILE = "point.json"
# checkpoints one run holds at once (every gcd(steps) steps up to max(steps))
MAX_CHECKPOINTS = 32


def _cli(args: list[str]) -> None:
    """``speculators-peagle ARGS`` in a child process (exits with one line if it fails)."""
    run_command([sys.executable, "-m", "speculators_peagle_plugin", *args])


# ------------------------------------------------------------------------------ points


def eval_settings(dtype: str) -> dict:
    """What every point is served with, as ``record.json``'s ``config`` holds it."""
    return {
        "prompt_sets": list(EVAL_SETS), "ks": [EVAL_K], "concurrency": [EVAL_CONCURRENCY],
        "prompts_per_slot": EVAL_PROMPTS_PER_SLOT, "max_new_tokens": EVAL_MAX_NEW_TOKENS,
        "baseline": False, "dtype": dtype, "kv_cache_gb": EVAL_KV_CACHE_GB,
        "enforce_eager": False,
    }


def eval_args(target: str, checkpoint: Path, dtype: str, out: Path) -> list[str]:
    """``speculators-peagle eval`` of one checkpoint with :func:`eval_settings`."""
    settings = eval_settings(dtype)
    order = ("ks", "concurrency", "prompts_per_slot", "baseline", "max_new_tokens", "dtype",
             "kv_cache_gb")
    values = {"target": target, "drafts": (str(checkpoint),),
              **{key: settings[key] for key in order}, "output_dir": str(out),
              "prompt_sets": settings["prompt_sets"], "enforce_eager": settings["enforce_eager"]}
    return ["eval", *config_argv(EvalConfig, values)]


def finished_eval(record_path: Path, checkpoint: Path, sha256: str, dtype: str) -> bool:
    """Whether ``record_path`` is an eval of this checkpoint (same weights) with
    :func:`eval_settings`."""
    if not record_path.is_file():
        return False
    record = json.loads(record_path.read_text())
    drafts = [(d["path"], d["sha256"]) for d in record["drafts"]]
    settings = eval_settings(dtype)
    return drafts == [(str(checkpoint.resolve()), sha256)] and all(
        record["config"].get(k) == v for k, v in settings.items()
    )


def served_figures(record: dict, checkpoint: Path) -> dict:
    """``{prompt set: {acceptance_length, per_position}}`` of the checkpoint at K 4."""
    return {
        r["prompt_set"]: {"acceptance_length": r["acceptance_length"],
                          "per_position": r["per_position"]}
        for r in record["runs"]
        if r["draft"] == str(checkpoint.resolve()) and r["k"] == EVAL_K
    }


def measure_point(cell: dict, checkpoint: Path, step: int, inputs: dict, config,
                  runner: Runner) -> dict:
    """One point: the checkpoint at ``step`` served and scored on held-out data
    (``step-<S>/point.json``, kept while the checkpoint's weights are the same)."""
    from speculators_peagle_plugin.evaluation.report import checkpoint_hash
    from speculators_peagle_plugin.training.heldout import heldout_metrics

    point_dir = Path(cell["dir"]) / f"step-{step}"
    done, record_path = point_dir / POINT_FILE, point_dir / "eval" / "record.json"
    sha256 = checkpoint_hash(checkpoint)
    if done.is_file():
        point = json.loads(done.read_text())
        if point["checkpoint_sha256"] == sha256:
            return point
    eval_s = None
    if not finished_eval(record_path, checkpoint, sha256, inputs["dtype"]):
        began = time.perf_counter()
        runner(eval_args(inputs["target"], checkpoint, inputs["dtype"], record_path.parent))
        eval_s = time.perf_counter() - began
    served = served_figures(json.loads(record_path.read_text()), checkpoint)
    began = time.perf_counter()
    held = heldout_metrics(checkpoint, config, inputs["validation_data"])
    point = {
        **{k: cell[k] for k in ("prompts", "rows", "layers", "seed")},
        "step": step,
        **trained_until(checkpoint.parent, step),
        "checkpoint": str(checkpoint),
        "checkpoint_sha256": sha256,
        "eval_s": eval_s,  # None: the eval ran in an earlier invocation
        "heldout_s": time.perf_counter() - began,
        "served": served,
        "heldout": {k: held[k] for k in ("acceptance_length", "accuracy_per_depth", "loss")},
        "eval_record": str(record_path),
    }
    atomic_write_text(done, json.dumps(point, indent=1) + "\n")
    return point


# -------------------------------------------------------------------------------- grid


def _ints(text: str, flag: str, low: int) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        values = []
    if not values or values[0] < low:
        kind = "positive integers" if low == 1 else f"integers >= {low}"
        raise SystemExit(f"{flag} must be comma-separated {kind}, got {text!r}.")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/long", help="A long-recipe run directory.")
    parser.add_argument("--prompts", default="220,1000,4430", help="Prefix sizes, in prompts.")
    parser.add_argument("--steps", default="500,1000,2000,4000",
                        help="Optimizer steps at which each cell is measured.")
    parser.add_argument("--seeds", action="append",
                        help="Comma-separated; repeatable [default: 42].")
    parser.add_argument("--num-layers", default="1,2", help="Draft depths.")
    parser.add_argument("--more-data", action="append", default=[],
                        help="A generate-data output of further training prompts, made with "
                        "the run data's settings; read after the run's (repeatable).")
    parser.add_argument("--config", default="configs/long_smollm2_train.yaml",
                        help="The training YAML.")
    parser.add_argument("--out", default="runs/scaling",
                        help="Prefix data, checkpoints and eval records.")
    parser.add_argument("--report", default="eval/scaling",
                        help="scaling.json and scaling.png, for eval/RESULTS.md.")
    args = parser.parse_args(argv)
    args.prompts = _ints(args.prompts, "--prompts", 1)
    args.steps = _ints(args.steps, "--steps", 1)
    args.seeds = _ints(",".join(args.seeds or ["42"]), "--seeds", 0)
    args.num_layers = _ints(args.num_layers, "--num-layers", 1)
    if checkpoint_count(args.steps) > MAX_CHECKPOINTS:
        raise SystemExit(
            f"--steps {','.join(map(str, args.steps))} need a checkpoint every "
            f"{math.gcd(*args.steps)} steps (their greatest common divisor), "
            f"{checkpoint_count(args.steps)} in one run; choose steps with a larger common "
            f"divisor (at most {MAX_CHECKPOINTS} checkpoints)."
        )
    return args


def run_grid(args: argparse.Namespace, runner: Runner = _cli) -> dict:
    """Every cell of the grid (prefix-major: the smallest first), then the record of every
    point under ``args.out``, the plot and the tables (``args.report``); returns the record."""
    from datasets import load_from_disk

    from speculators_peagle_plugin.evaluation.report import provenance
    from speculators_peagle_plugin.training.train_config import TrainConfig

    run_dir, out = Path(args.run_dir), Path(args.out).resolve()
    inputs = run_inputs(run_dir)
    if not Path(args.config).is_file():
        raise SystemExit(f"--config {args.config} is not a file; give the training YAML.")
    inputs["more_data"] = more_data_inputs(run_dir, inputs, args.more_data)
    sources = [{"data": inputs["data"], "prompts": inputs["prompts"]}, *inputs["more_data"]]
    of_row, total = [], 0  # the prompt (counted over every source) each row answers
    for source in sources:
        echo(f"mapping the rows of {source['data']} to {source['prompts']}")
        prompt_ids = rendered_prompts(source["prompts"], inputs["target"])
        rows = load_from_disk(source["data"]).with_format(None)["input_ids"]
        try:
            of_row += [total + p for p in prompt_of_rows(rows, prompt_ids)]
        except ValueError as err:
            msg = f"{source['data']} was not generated from {source['prompts']}: {err}."
            raise SystemExit(msg) from None
        total += len(prompt_ids)
    too_many = [n for n in args.prompts if n > total]
    if too_many:
        raise SystemExit(
            f"--prompts {too_many[0]} is more than the {total} prompts of "
            f"{' + '.join(s['prompts'] for s in sources)}."
        )
    native_bf16 = cpu_has_bfloat16()
    yaml_path = train_yaml(Path(args.config), out / "train.yaml", native_bf16)
    yaml_sha256 = digest(yaml_path.read_bytes())

    def config_for(data: Path, save: Path, layers: int, seed: int) -> TrainConfig:
        return TrainConfig.from_sources(
            str(yaml_path), verifier_name_or_path=inputs["target"], data_path=str(data),
            save_path=str(save), num_layers=layers, seed=seed,
        )

    vocab = config_for(Path(inputs["data"]), out, 1, 0).draft.draft_vocab_size
    cells = [(n, layers, seed) for n in args.prompts for layers in args.num_layers
             for seed in args.seeds]
    for n, layers in sorted({(n, layers) for n, layers, _ in cells}):
        check_schedule(out / "cells", n, layers, max(args.steps))
    for i, (n, layers, seed) in enumerate(cells):
        count = sum(p < n for p in of_row)  # rows come in prompt order
        if count == 0:
            raise SystemExit(f"the first {n} prompts of {inputs['prompts']} have no data row.")
        data = out / "data" / f"prompts-{n}"
        name = cell_name(n, layers, seed)
        echo(f"[{i + 1}/{len(cells)}] {name}: data {data} ({count} rows)")
        prefix_data([Path(s["data"]) for s in sources], count, data, vocab)
        config = config_for(data, out / "cells" / name / "train", layers, seed)
        cell = {"dir": str(out / "cells" / name), "prompts": n, "rows": count,
                "layers": layers, "seed": seed}
        per_epoch = steps_per_epoch(data, config.data.total_seq_len)
        plan = {**{k: cell[k] for k in ("prompts", "rows", "layers", "seed")},
                "steps": args.steps, "config_sha256": yaml_sha256, "data": str(data),
                **checkpoint_plan(args.steps, per_epoch)}
        echo(f"[{i + 1}/{len(cells)}] {name}: train {plan['max_steps']} steps, a checkpoint "
              f"every {plan['every']} ({plan['steps_per_epoch']} steps an epoch)")
        train_args = config_argv(TrainConfig, {
            "verifier_name_or_path": inputs["target"], "data_path": str(data),
            "num_layers": layers, "seed": seed,
        }, config_file=yaml_path)
        save = train_cell(Path(cell["dir"]), plan, train_args, args.steps, runner)
        for step in args.steps:
            echo(f"[{i + 1}/{len(cells)}] {name}: step {step}: eval + held-out estimate")
            measure_point(cell, save / f"checkpoint-{step}", step, inputs, config, runner)
    points = [json.loads(p.read_text()) for p in sorted(out.glob(f"cells/*/step-*/{POINT_FILE}"))]
    summary = summarise(points)
    record = {
        "provenance": provenance(["python", "-m", "eval.scaling", *sys.argv[1:]]),
        "native_bfloat16": native_bf16,
        "run": inputs,
        "train_yaml": str(yaml_path),
        "eval": eval_settings(inputs["dtype"]),
        "grid": {k: getattr(args, k) for k in ("prompts", "steps", "seeds", "num_layers")},
        "points": points,
        "summary": [
            {"prompts": n, "layers": layers, "step": s, **figs}
            for (n, layers, s), figs in summary.items()
        ],
    }
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    atomic_write_text(report / "scaling.json", json.dumps(record, indent=1) + "\n")
    if summary:
        plot(summary, report / "scaling.png")
    print(tables(summary))
    print(f"record: {report / 'scaling.json'}  plot: {report / 'scaling.png'}")
    return record


def main() -> None:
    run_grid(parse_args())


if __name__ == "__main__":
    main()
