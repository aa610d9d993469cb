"""Cells at once (``eval.ablate --lanes N``): the demo's training in N processes, each on its
share of the cores, against one process on all of them.

    .venv/bin/python -m eval.bench_lanes [--demo-dir runs/demo] [--lanes 2] [--steps 50]
        [--skip 20] [--repeats 2] [FIELD=VALUE ...]

Both arms train the demo's YAML on its data (with the ``FIELD=VALUE`` overrides, as an
ablation variant sets them), seed 42, for ``--steps`` optimizer steps: one process with
torch's default threads, then ``--lanes`` processes started together, each pinned to its
:func:`~speculators_peagle_plugin.common.devices.cpu_shares` share. A process's rate is its
supervised-and-masked tokens over the wall time of its steps after ``--skip`` (the warm-up);
the lanes' is the sum of theirs. The arms alternate ``--repeats`` times. The machine must be
otherwise idle.
"""

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from eval.ablate import _variant_yaml, parse_variant, train_command
from eval.demo_run import demo_inputs
from eval.processes import exit_on_sigterm
from speculators_peagle_plugin.common.devices import cpu_shares, start_on_cores, usable_cores
from speculators_peagle_plugin.common.files import METRICS_FILE


def rate(save: Path, skip: int) -> float:
    """Tokens per second of a training's steps after the first ``skip`` (``metrics.jsonl``:
    per step its ``tokens`` and the ``wall_s`` since the training began)."""
    records = [json.loads(line) for line in (save / METRICS_FILE).read_text().splitlines()]
    if len(records) <= skip:
        raise SystemExit(f"{save} has {len(records)} steps; --steps must exceed --skip.")
    began = records[skip - 1]["wall_s"] if skip else 0.0
    return sum(r["tokens"] for r in records[skip:]) / (records[-1]["wall_s"] - began)


def arm(demo: dict, config: Path, shares: list, steps: int, skip: int, root: Path) -> float:
    """The summed rate of one training per share, started together (a share of None: one
    process with the environment as it is)."""
    running = []
    for k, share in enumerate(shares):
        save = root / f"lane-{k}"
        shutil.rmtree(save, ignore_errors=True)
        cmd = train_command(demo, config, demo["data"], save, 42, steps)
        env, cores = (dict(os.environ), None) if share is None else (
            {**os.environ, **share[0]}, share[1])
        running.append((save, start_on_cores(cmd, env, cores, root / f"lane-{k}.log")))
    for save, process in running:
        if process.wait() != 0:
            raise SystemExit(f"training {save} failed; its log is {save}.log.")
    return sum(rate(save, skip) for save, _ in running)


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="FIELD=VALUE")
    parser.add_argument("--demo-dir", default="runs/demo")
    parser.add_argument("--lanes", type=int, default=2, help="Processes at once [2].")
    parser.add_argument("--steps", type=int, default=50, help="Steps per training [50].")
    parser.add_argument("--skip", type=int, default=20, help="Warm-up steps, untimed [20].")
    parser.add_argument("--repeats", type=int, default=2, help="Rounds of both arms [2].")
    args = parser.parse_args()
    cores = usable_cores()
    if not 2 <= args.lanes <= len(cores):
        raise SystemExit(f"--lanes {args.lanes}: use 2 to {len(cores)}, a core per lane.")
    demo = demo_inputs(Path(args.demo_dir))
    _, overrides = parse_variant(["bench", *args.overrides])
    with tempfile.TemporaryDirectory(prefix="bench-lanes-") as tmp:
        root = Path(tmp)
        config = _variant_yaml(demo, overrides, root / "train.yaml")
        print(f"{args.lanes} lanes on {len(cores)} cores, {args.steps} steps each (the first "
              f"{args.skip} untimed), overrides {overrides or 'none'}\n")
        print(f"| round | one process (tokens/s) | {args.lanes} lanes together (tokens/s) | "
              "ratio |")
        print("|---|---:|---:|---:|")
        for round_ in range(1, args.repeats + 1):
            one = arm(demo, config, [None], args.steps, args.skip, root)
            lanes = arm(demo, config, cpu_shares(args.lanes), args.steps, args.skip, root)
            print(f"| {round_} | {one:.0f} | {lanes:.0f} | {lanes / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
