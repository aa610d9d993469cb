"""What the training loop costs over the bare trainer-module step.

Both sides run in fresh subprocesses, alternating, on the same config, data and steps:

- ``bare``: ``build_training`` once, the row batches loaded into memory beforehand, then
  per step only ``zero_grad -> forward/backward per segment -> clip -> AdamW -> schedule``.
- ``loop``: ``speculators_peagle_plugin.training.loop.train`` (the CLI's loop): reading and
  packing the hidden-state files every step (the next step's row on a thread while this
  step trains), the DDP-safe step module, metrics reduction, progress bar, JSONL log;
  checkpoints are written only at the end (outside the timed steps).
- ``in-line``: the same loop reading each row when its step starts, on the loop's thread.

The figure is the median step wall time after ``--warmup`` steps; the ratio loop/bare is
the overhead.

    .venv/bin/python -m eval.bench_loop --target DIR --data DIR --config configs/demo_smollm2.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eval.processes import exit_on_sigterm

SIDES = ("bare", "loop", "in-line")


def _config(args, save_path: str):
    from speculators_peagle_plugin.options import load_config
    from speculators_peagle_plugin.training.train_config import TrainConfig

    flags = dict(
        verifier_name_or_path=args.target, data_path=args.data, save_path=save_path,
        max_steps=str(args.warmup + args.steps), no_resume_from_checkpoint=True,
        checkpoint_freq="1000",
    )
    return load_config(TrainConfig, args.config, flags)


def run_bare(args) -> list[float]:
    import torch

    from speculators_peagle_plugin.training.loop import build_training
    from speculators_peagle_plugin.training.step import autocast_context, cod_generator
    from speculators_peagle_plugin.training.step import to_device as _to_device

    with tempfile.TemporaryDirectory() as save:
        config = _config(args, save)
        setup = build_training(config)
        dtype = getattr(torch, config.runtime.dtype)
        steps = args.warmup + args.steps
        per_epoch = len(setup.batches)
        batches = [
            _to_device(setup.batches.batch(*divmod(s, per_epoch)), setup.world.device, dtype)
            for s in range(steps)
        ]
        module, times = setup.module, []
        params = [p for p in module.parameters() if p.requires_grad]
        for step, batch in enumerate(batches):
            began = time.perf_counter()
            setup.optimizers.zero_grad(set_to_none=True)
            module.generator = cod_generator(config.seed, step, 0, setup.world.device)
            if config.peagle.sequence_partitions > 1:
                plan = module.build_peagle_plan(
                    batch["loss_mask"], document_ids=batch["document_ids"]
                )
                segments = [{"peagle_segment": (plan, i)} for i in range(len(plan))]
            else:
                segments = [{}]
            for segment in segments:
                with autocast_context(config.runtime, setup.world.device):  # as the loop's forwards
                    out = module.forward_batch(batch, **segment)
                out.loss.backward()
            if config.optimizer.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, config.optimizer.max_grad_norm)
            setup.optimizers.step()
            setup.schedulers.step()
            times.append(time.perf_counter() - began)
    return times[args.warmup :]


def run_loop(args, ahead: bool = True) -> list[float]:
    from functools import partial

    from speculators_peagle_plugin.training import loop
    from speculators_peagle_plugin.training.loop import train
    from speculators_peagle_plugin.training.progress import METRICS_FILE

    if not ahead:
        loop.RowsAhead = partial(loop.RowsAhead, ahead=False)
    with tempfile.TemporaryDirectory() as save:
        train(_config(args, save), progress=True)
        walls = [
            json.loads(line)["wall_s"]
            for line in (Path(save) / METRICS_FILE).read_text().splitlines()
        ]
    steps = [b - a for a, b in zip([0.0, *walls], walls, strict=False)]
    return steps[args.warmup :]


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--config", default="configs/demo_smollm2.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per side")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        times = run_bare(args) if args.side == "bare" else run_loop(args, args.side == "loop")
        print(json.dumps({"times": times}))
        return
    results: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:
            out = subprocess.run(
                [sys.executable, "-m", "eval.bench_loop", *sys.argv[1:], "--side", side],
                capture_output=True, text=True, check=True,
            )
            results[side] += json.loads(out.stdout.strip().splitlines()[-1])["times"]
    bare, loop, in_line = (statistics.median(results[s]) for s in SIDES)
    print(
        f"median step: bare {bare:.3f} s, loop {loop:.3f} s (overhead {loop / bare - 1:+.1%}), "
        f"rows read in line {in_line:.3f} s ({in_line / bare - 1:+.1%})"
    )
    print(json.dumps({
        "bare_s": bare, "loop_s": loop, "in_line_s": in_line, "overhead": loop / bare - 1,
        "in_line_overhead": in_line / bare - 1,
    }))


if __name__ == "__main__":
    main()
