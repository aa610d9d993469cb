"""What the evaluation scripts take from a finished demo run, and how they run commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from speculators_peagle_plugin.demo.artifacts import RunLayout
from speculators_peagle_plugin.demo.stages import STATE_FILE
from speculators_peagle_plugin.demo.summary import SUMMARY_FILE
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.options import config_argv
from speculators_peagle_plugin.training.train_config import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def run_command(args: list[str]) -> str:
    """Run ``args`` (from the repository root, offline), show its output but its ``RESULT``
    lines, and return its stdout; exit with a one-line message if it fails."""
    print("$ " + " ".join(args), file=sys.stderr, flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(args, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
    sys.stdout.write("".join(line for line in done.stdout.splitlines(True)
                             if not line.startswith("RESULT ")))
    if done.returncode != 0:
        raise SystemExit(f"{args[2:4]} failed with exit code {done.returncode} (output above).")
    return done.stdout


def _demo_training(stages: dict, layout: RunLayout, train_config: str) -> dict | None:
    """The demo's final checkpoint, training time and seed, if it trained."""
    if "train" not in stages:
        return None
    checkpoint = Path(stages["train"]["outputs"]["checkpoint"]).name
    return {
        "checkpoint": str(layout.train.resolve() / checkpoint),
        "train_s": stages["train"]["seconds"],
        "seed": yaml.safe_load(Path(train_config).read_text()).get("seed", TrainConfig.seed),
    }


def demo_inputs(demo_dir: Path) -> dict:
    """The demo's target, data and training YAML, from its ``stages.json``."""
    stages_path = demo_dir / STATE_FILE
    stages = json.loads(stages_path.read_text()) if stages_path.is_file() else {}
    summary = demo_dir / SUMMARY_FILE
    if "data" not in stages or "target" not in stages or not summary.is_file():
        raise SystemExit(
            f"{demo_dir} holds no finished demo; run `make demo` first (or pass --demo-dir)."
        )
    config = json.loads(summary.read_text())["config"]
    layout = RunLayout(demo_dir)
    return {
        "target": stages["target"]["outputs"]["path"],
        # stages.json holds the data's path relative to where the demo ran, which need not
        # be this process's working directory: take it from the run layout instead
        "data": str(layout.data.resolve()),
        "config": config["train_config"],
        "steps_demo": config["max_steps"],
        "max_new_tokens": config["max_new_tokens"],
        # prompts generated together: the speed of a data stage, not its replies
        "gen_batch_size": config["gen_batch_size"],
        "eval_max_new_tokens": config["eval_max_new_tokens"],
        # acceptance only: the demo's largest concurrency decodes its whole held-out sets
        "eval_concurrency": max(config["eval_concurrency"]),
        "kv_cache_gb": config["kv_cache_gb"],
        # the dtype the target wrote the data in is the one the drafts are served with
        # (a data stage that records no dtype was written in float32)
        "dtype": stages["data"]["inputs"].get("dtype", "float32"),
        "k": config["num_speculative_tokens"],
        "eval_prompts": config["eval_prompts"],
        # whether the demo trained with native bfloat16: every arm trained beside its draft
        # trains with the same precision (``common.devices.cpu_train_settings``)
        "native_bf16": stages.get("train", {}).get("inputs", {}).get("native_bf16", True),
        # the demo's own training: an arm with its recipe, seed and steps need not train again
        "trained": _demo_training(stages, layout, config["train_config"]),
    }


def served_acceptance(demo: dict, drafts: list[str], prompts: list[str], out: Path) -> dict:
    """The drafts in one ``speculators-peagle eval`` run, served as the demo serves its own
    (its K, greedy, no baseline; uncompiled engines, which start sooner: no speed is read);
    ``{draft: {prompt set: acceptance length, per position}}``."""
    args = config_argv(EvalConfig, {
        "target": demo["target"], "ks": (demo["k"],), "baseline": False, "enforce_eager": True,
        "max_new_tokens": demo["eval_max_new_tokens"], "concurrency": (demo["eval_concurrency"],),
        "kv_cache_gb": demo["kv_cache_gb"], "dtype": demo["dtype"], "output_dir": str(out),
        "drafts": tuple(drafts), "prompt_sets": tuple(prompts),
    })
    run_command([sys.executable, "-m", "speculators_peagle_plugin", "eval", *args])
    runs = json.loads((out / "record.json").read_text())["runs"]
    return {
        draft: {r["prompt_set"]: {"acceptance_length": r["acceptance_length"],
                                  "per_position": r["per_position"]}
                for r in runs if r["draft"] == str(Path(draft).resolve())}
        for draft in drafts
    }
