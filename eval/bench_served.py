"""Benchmark: training tokens/s, hidden states from files, the target in process, or `vllm serve`.

Usage (after ``make demo``, whose target, data and training YAML every arm shares)::

    .venv/bin/python -m eval.bench_served [--demo-dir runs/demo] [--out runs/bench-served]
        [--steps 50] [--warmup 5] [--seeds 42] [--servers 1 2] [--kv-cache-gb 1]
        [--enforce-eager] [--online] [--serve]

Arms, each ``speculators-peagle train`` with the same YAML, target, seed, rows and steps:

- ``files``: the data's hidden states read from its ``hidden_states/``;
- ``online`` (with ``--online``): the same rows' token ids alone (``OUT/tokens``: the data
  without ``hidden_states/``), the states computed by the target inside training (``train
  --online``, in the data's dtype), with no server up;
- ``N server(s)``: the same token ids, every row's states fetched from N ``vllm serve``
  processes of the target (``extract_hidden_states`` and our connector,
  :func:`served_states.serve_command`; ``--vllm-endpoint`` once per server). Server k runs
  its CPU engine on the k-th core counted from the last (``VLLM_CPU_OMP_THREADS_BIND``,
  unless the environment sets it) with a ``--kv-cache-gb`` GiB KV cache, in the data's
  dtype. The servers start before their arm and are not timed; the other arms run with none
  up.

Per arm and seed (a cell), from the run's ``metrics.jsonl``: training tokens/s over the
steps after ``--warmup`` (their tokens over their wall time), the share of those steps spent
waiting for rows (``data_share``), the loss at every step, its largest difference from the
files arm's at the same seed, and the final loss. ``--serve`` also serves each cell's final
draft as the demo serves its own (:func:`eval.demo_run.served_acceptance`: the demo's K and
prompt sets); ``--seeds 42,0,1 --steps 0 --serve`` (the demo's own steps) is the 3-seed
acceptance comparison. ``OUT/bench_served.json`` holds the provenance, the inputs, the
files' hidden-state bytes per token, and every cell. ``--target``, ``--data`` and
``--config`` together stand in for the demo directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

import yaml

from eval.demo_run import REPO, demo_inputs, run_command, served_acceptance
from eval.processes import exit_on_sigterm, free_port, started, wait_healthy
from speculators_peagle_plugin.common.files import atomic_write_json
from speculators_peagle_plugin.evaluation.report import provenance

FILES = "files"
ONLINE = "online"


def arm_name(servers: int) -> str:
    return FILES if servers == 0 else f"{servers} server" + ("s" if servers > 1 else "")


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-dir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--target", help="with --data and --config: instead of --demo-dir")
    parser.add_argument("--data", help="training data with hidden_states/ (see --target)")
    parser.add_argument("--config", help="training YAML (see --target)")
    parser.add_argument("--dtype", help="the servers' dtype [default: the data's]")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-served"))
    parser.add_argument("--steps", type=int, default=50, help="0: the demo's own steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps")
    parser.add_argument("--seeds", help="comma-separated [default: the YAML's seed]")
    parser.add_argument(
        "--servers", type=int, nargs="+", default=[1, 2], help="server counts, one arm each"
    )
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="per server (CPU)")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="uncompiled servers (start sooner; vllm serve compiles)",
    )
    parser.add_argument(
        "--online", action="store_true", help="also the arm with the target in process"
    )
    parser.add_argument(
        "--serve", action="store_true", help="serve each cell's draft on the demo's prompt sets"
    )
    args = parser.parse_args(argv)
    if min(args.servers) < 1 or args.warmup < 0:
        parser.error("--servers takes counts >= 1 and --warmup a count >= 0")
    return args


def bench_inputs(args) -> dict:
    """The target, data, YAML and dtype: the demo's, or the flags' when all three are given."""
    given = (args.target, args.data, args.config)
    if all(given):
        inputs = {
            "target": args.target,
            "data": args.data,
            "config": args.config,
            "dtype": _recorded(Path(args.data), "dtype") or "float32",
            "native_bf16": True,  # the YAML's precision as written
        }
    elif any(given):
        raise SystemExit("--target, --data and --config go together (else --demo-dir).")
    else:
        inputs = demo_inputs(args.demo_dir)
    inputs["dtype"] = args.dtype or inputs["dtype"]
    for key in ("target", "data", "config"):  # the training runs from the repository root
        inputs[key] = str(Path(inputs[key]).resolve())
    return inputs


def _recorded(data: Path, key: str):
    """``key`` of the data's generation settings; None if it records none."""
    from speculators_peagle_plugin.data.layout import SETTINGS_FILE

    settings = data / SETTINGS_FILE
    return json.loads(settings.read_text()).get(key) if settings.is_file() else None


def _native_bf16(inputs: dict) -> bool:
    """Whether the demo trained with native bfloat16 (``demo_inputs``: ``native_bf16``, or
    ``autocast_none`` its negation)."""
    return inputs.get("native_bf16", not inputs.get("autocast_none", False))


def token_ids_only(data: Path, out: Path) -> Path:
    """``data`` without its ``hidden_states/`` (token ids, loss masks, vocabulary files and
    settings), copied once to ``out``."""
    if not out.is_dir():  # written under another name, renamed when complete
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(data, tmp, ignore=shutil.ignore_patterns("hidden_states"))
        tmp.rename(out)
    return out


def server_command(inputs: dict, hs_dir: Path, port: int, enforce_eager: bool) -> list[str]:
    """The docs' server of the target (:func:`served_states.serve_command`) with the aux
    layers the data records, on ``port``, holding the data's longest row."""
    from datasets import load_from_disk
    from transformers import AutoConfig

    from speculators_peagle_plugin.data.layout import default_target_layer_ids
    from speculators_peagle_plugin.datagen.served_states import serve_command

    num_layers = AutoConfig.from_pretrained(inputs["target"]).num_hidden_layers
    data = Path(inputs["data"])
    layer_ids = _recorded(data, "target_layer_ids") or default_target_layer_ids(num_layers)
    longest = max(int(n) for n in load_from_disk(str(data))["seq_len"])
    launcher = (sys.executable, "-m", "speculators_peagle_plugin", "vllm")
    command = serve_command(inputs["target"], layer_ids, num_layers, str(hs_dir), launcher=launcher)
    command += f"--host 127.0.0.1 --port {port} --dtype {inputs['dtype']}".split()
    command += ["--max-model-len", str(longest + 16)]  # a one-token completion of each row
    return command + (["--enforce-eager"] if enforce_eager else [])


def _server_env(k: int, kv_cache_gb: int) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": str(cores[-1 - k % len(cores)]),
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def start_servers(stack: ExitStack, args, inputs: dict, first: int, count: int) -> list[str]:
    """Servers ``first`` to ``count - 1`` started at once and left to ``stack`` to stop;
    their base URLs once each ``/health`` answers."""
    launched = []
    for k in range(first, count):
        port = free_port()
        command = server_command(inputs, args.out / f"server-states-{k}", port, args.enforce_eager)
        log = args.out / f"server-{k}.log"
        server = stack.enter_context(started(command, _server_env(k, args.kv_cache_gb), log))
        launched.append((server, f"http://127.0.0.1:{port}", log))
    for server, base, log in launched:
        wait_healthy(server, base, log)
    return [base for _, base, _ in launched]


def train_cell(
    inputs: dict, data: str, save: Path, seed: int, steps: int, source: list[str]
) -> Path:
    """One training run from scratch into ``save`` (``source``: the flags that say where
    its hidden states come from); its metrics log."""
    from speculators_peagle_plugin.training.progress import METRICS_FILE

    shutil.rmtree(save, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "speculators_peagle_plugin",
        "train",
        "--config",
        inputs["config"],
        "--verifier-name-or-path",
        inputs["target"],
        "--data-path",
        data,
        "--save-path",
        str(save),
        "--seed",
        str(seed),
        "--max-steps",
        str(steps),
        "--log-freq",
        "1",
        "--checkpoint-freq",
        "1000",
    ]
    if not _native_bf16(inputs):  # every arm trains with the demo's precision
        cmd += ["--autocast", "none"]
    run_command(cmd + source)
    return save / METRICS_FILE


def figures(metrics: Path, warmup: int) -> dict:
    """Tokens/s over the steps after ``warmup`` (their tokens over their wall time), their
    mean share spent waiting for rows, and the loss of every step.

    Example: wall_s [1, 2, 4], tokens [10, 10, 30], warmup 1 -> 40 tokens in 3 s.
    """
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = records[warmup:]
    if not timed:
        raise SystemExit(f"{metrics}: no step after the {warmup} warm-up step(s).")
    began = records[warmup - 1]["wall_s"] if warmup else 0.0
    return {
        "steps": len(records),
        "tokens_per_s": sum(r["tokens"] for r in timed) / (timed[-1]["wall_s"] - began),
        "data_share": sum(r["data_share"] for r in timed) / len(timed),
        "losses": [r["loss"] for r in records],
        "final_loss": records[-1]["loss"],
    }


def compare_losses(cells: list[dict]) -> None:
    """Set each cell's largest loss difference from the files arm at its seed."""
    files = {c["seed"]: c["losses"] for c in cells if c["arm"] == FILES}
    for cell in cells:
        ref = files.get(cell["seed"])
        cell["max_loss_diff"] = (
            None
            if ref is None
            else max((abs(a - b) for a, b in zip(cell["losses"], ref, strict=True)), default=0.0)
        )


def run_arms(args, inputs: dict, seeds: list[int], steps: int) -> list[dict]:
    """Every cell: the files arm and the online arm with no server up, then each server
    count, the servers added as the counts grow and stopped at the end."""
    tokens = str(token_ids_only(Path(inputs["data"]), args.out / "tokens"))
    cells, urls = [], []

    def run(arm: str, count: int, data: str, source: list[str]) -> None:
        for seed in seeds:
            save = args.out / arm.replace(" ", "-") / f"seed-{seed}"
            metrics = train_cell(inputs, data, save, seed, steps, source)
            cell = {"arm": arm, "servers": count, "seed": seed, "save": str(save)}
            cells.append(cell | figures(metrics, args.warmup))

    run(FILES, 0, inputs["data"], [])
    if args.online:
        run(ONLINE, 0, tokens, ["--online", "--target-dtype", inputs["dtype"]])
    with ExitStack() as servers:
        for count in sorted(set(args.servers)):
            urls += start_servers(servers, args, inputs, len(urls), count)
            run(arm_name(count), count, tokens, [f"--vllm-endpoint={url}" for url in urls])
    compare_losses(cells)
    return cells


def serve_cells(inputs: dict, cells: list[dict], out: Path) -> None:
    """Each cell's final draft served as the demo serves its own, one eval run per seed."""
    from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs

    for seed in sorted({c["seed"] for c in cells}):
        mine = [c for c in cells if c["seed"] == seed]
        drafts = [str(checkpoint_dirs(Path(c["save"]))[-1]) for c in mine]
        served = served_acceptance(inputs, drafts, inputs["eval_prompts"], out / f"eval-{seed}")
        for cell, draft in zip(mine, drafts, strict=True):
            cell["acceptance"] = {spec: r["acceptance_length"] for spec, r in served[draft].items()}


def table(cells: list[dict]) -> str:
    """The cells as a markdown table."""
    specs = sorted({s for c in cells for s in c.get("acceptance", {})})
    head = [
        "arm",
        "seed",
        "steps",
        "tokens/s",
        "waiting for rows",
        "final loss",
        "max |loss - files|",
        *(f"acceptance {s}" for s in specs),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        diff = "" if c["max_loss_diff"] is None else f"{c['max_loss_diff']:.2e}"
        row = [
            c["arm"],
            str(c["seed"]),
            str(c["steps"]),
            f"{c['tokens_per_s']:.0f}",
            f"{c['data_share']:.0%}",
            f"{c['final_loss']:.4f}",
            diff,
            *(f"{c['acceptance'][s]:.3f}" for s in specs if "acceptance" in c),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def arms(args) -> list[str]:
    return [FILES, *[ONLINE] * args.online, *map(arm_name, sorted(set(args.servers)))]


def state_bytes_per_token(data: Path) -> float:
    """The bytes the data's ``hidden_states/`` take on disk per token of its rows."""
    from datasets import load_from_disk

    stored = sum(f.stat().st_size for f in (data / "hidden_states").rglob("*") if f.is_file())
    return stored / sum(int(n) for n in load_from_disk(str(data))["seq_len"])


def _seeds_and_steps(args, inputs: dict) -> tuple[list[int], int]:
    from speculators_peagle_plugin.training.train_config import TrainConfig

    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        seeds = [yaml.safe_load(Path(inputs["config"]).read_text()).get("seed", TrainConfig.seed)]
    steps = args.steps or inputs.get("steps_demo")
    if not steps:
        raise SystemExit("--steps 0 means the demo's own steps: give --demo-dir, or --steps N.")
    if steps <= args.warmup:
        raise SystemExit(f"--steps {steps} leaves no timed step after --warmup {args.warmup}.")
    return seeds, steps


def main(argv=None) -> None:
    args = _parse_args(argv)
    exit_on_sigterm()
    inputs = bench_inputs(args)
    if args.serve and "eval_prompts" not in inputs:
        raise SystemExit("--serve serves on the demo's prompt sets: give --demo-dir.")
    seeds, steps = _seeds_and_steps(args, inputs)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = run_arms(args, inputs, seeds, steps)
    if args.serve:
        serve_cells(inputs, cells, args.out)
    atomic_write_json(
        args.out / "bench_served.json",
        {
            "provenance": provenance(),
            "inputs": inputs,
            "seeds": seeds,
            "steps": steps,
            "warmup": args.warmup,
            "arms": arms(args),
            "state_bytes_per_token": state_bytes_per_token(Path(inputs["data"])),
            "kv_cache_gb": args.kv_cache_gb,
            "enforce_eager": args.enforce_eager,
            "cells": cells,
        },
    )
    print(table(cells))


if __name__ == "__main__":
    main()
