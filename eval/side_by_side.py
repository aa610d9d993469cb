"""This plugin vs speculators 0.9.0's built-in P-EAGLE: same data, draft, steps and seed.

Usage (after ``make demo``, whose target, data and training config it reuses)::

    .venv/bin/python -m eval.side_by_side [--demo-dir runs/demo] [--out runs/side-by-side]
        [--steps N] [--seed S] [--eval-prompts humaneval[120:164] --eval-prompts chat[100:]]

Both sides start from ONE draft:
:func:`~speculators_peagle_plugin.training.loop.build_training` on the demo's YAML builds
it (layers, draft vocabulary, K, r, r_min, seed), and the speculators side copies its
weights into ``speculators.models.peagle.core.PEagleDraftModel``
(``load_state_dict(strict=True)``) with the same trainable parameters.
``--theirs-draft speculators`` gives theirs the draft ``speculators train`` builds instead:
the same YAML without the recipe's draft-construction choices that speculators does not
make (``SPECULATORS_DRAFT``: the layer starts random, with the verifier's key/value heads),
built by the same code on speculators' own ``from_training_args``. Both then take the
same packed rows in the same order, with the same AdamW (whatever the YAML's optimizer),
warmup schedule, gradient clipping and precision (the YAML's ``autocast``: forwards under
``torch.autocast``, as speculators' ``Trainer`` runs them), for the same number of
optimizer steps:

- ours: ``speculators_peagle_plugin.training.loop.train`` (the ``speculators-peagle train``
  loop, sequence partitions and all, as configured in the YAML);
- theirs: a minimal loop around speculators' forward (its ``Trainer`` needs a GPU):
  eager KL loss, its own COD sampler on the global torch RNG, seeded per step, with
  ``speculators train``'s cap on chain starts and COD decay ratio r (``--theirs-max-anchors
  none`` / ``--theirs-down-sample-ratio none``: ours).

Each side trains in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own; the
training time is the optimizer-step loop alone (data opened, draft built and checkpoint
written outside it, on both sides). Then both drafts are served by vLLM's parallel-drafting
runtime in one ``speculators-peagle eval`` run on the held-out prompts. The figures go to
``OUT/side_by_side.json`` and a markdown table on stdout (pasted into eval/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eval.demo_run import demo_inputs, run_command, served_acceptance
from eval.measure import peak_rss_gib
from speculators_peagle_plugin.common.files import atomic_write_text
from speculators_peagle_plugin.evaluation.report import provenance

SIDES = {"ours": "peagle-plugin", "theirs": "speculators-builtin"}  # side -> draft dir name
# The YAML keys of the draft's construction whose TrainConfig defaults are what
# `speculators train` builds (a random layer with the verifier's key/value heads).
SPECULATORS_DRAFT = ("draft_init", "num_key_value_heads")


def _train_config(spec: dict, side: str):
    from speculators_peagle_plugin.common.settings import leaves
    from speculators_peagle_plugin.training.train_config import TrainConfig

    # One checkpoint, at the end: neither side pays for saves inside its loop. Both step
    # AdamW (theirs is a minimal loop of it), whatever optimizer the YAML names.
    seed = {} if spec.get("seed") is None else {"seed": spec["seed"]}
    config = TrainConfig.from_sources(
        spec["config"], verifier_name_or_path=spec["target"], data_path=spec["data"],
        save_path=str(Path(spec["out"]) / f"{side}-train"), max_steps=spec["steps"],
        checkpoint_freq=1e9, keep_checkpoints=1, log_freq=1, no_resume_from_checkpoint=True,
        optimizer="adamw", **seed,
    )
    if side == "theirs" and spec.get("theirs_draft") == "speculators":
        defaults = {leaf.key: leaf.default for leaf in leaves(TrainConfig)}
        config = config.replace(**{k: defaults[k] for k in SPECULATORS_DRAFT})
    return config


def train_ours(spec: dict) -> dict:
    """The plugin's own training loop; the draft is linked to ``OUT/peagle-plugin``."""
    from speculators_peagle_plugin.demo.artifacts import link_draft
    from speculators_peagle_plugin.training.loop import train
    from speculators_peagle_plugin.training.progress import METRICS_FILE

    config = _train_config(spec, "ours")
    checkpoint = train(config)
    save_path = Path(config.trainer.checkpoints.save_path)
    records = [json.loads(line) for line in open(save_path / METRICS_FILE)]
    draft = Path(spec["out"]) / SIDES["ours"]
    link_draft(checkpoint, draft)
    return {
        "steps": records[-1]["step"],
        "train_s": records[-1]["wall_s"],  # first step start -> last step end
        "losses": [r["loss"] for r in records],
        "draft": str(draft),
    }


def train_theirs(spec: dict) -> dict:
    """speculators' ``PEagleDraftModel`` from the same initial weights, in a minimal loop."""
    import speculators.models.peagle.core as core
    import torch
    from speculators.losses import resolve_loss_config
    from torch import nn

    from speculators_peagle_plugin.demo.artifacts import save_atomically
    from speculators_peagle_plugin.training.loop import build_training
    from speculators_peagle_plugin.training.optim import build_scheduler
    from speculators_peagle_plugin.training.step import autocast_context, cod_generator

    config = _train_config(spec, "theirs")
    setup = build_training(config)  # data, vocab mapping, mask token, seeded draft, schedule
    model = core.PEagleDraftModel(setup.draft.config)
    model.load_state_dict(setup.draft.state_dict(), strict=True)
    trainable = {n for n, p in setup.draft.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    batches, total = setup.batches, setup.total_steps
    del setup  # our draft, trainer and optimizer: not in this side's memory
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = config.optimizer
    optimizer = torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
    scheduler = build_scheduler(optimizer, config.scheduler, total)
    loss_config = resolve_loss_config("kl_div", "eager")
    cod = config.peagle.cod
    max_anchors = spec.get("theirs_max_anchors", cod.max_anchors)
    ratio = spec.get("theirs_down_sample_ratio") or cod.down_sample_ratio
    losses = []
    began = time.perf_counter()
    for step in range(total):
        epoch, index = divmod(step, len(batches))
        batch = batches.batch(epoch, index)
        # speculators' COD sampler draws from the global RNG: seed it per step, as ours is
        cod_seed = cod_generator(config.seed, step, 0, torch.device("cpu")).initial_seed()
        torch.manual_seed(int(cod_seed))
        optimizer.zero_grad(set_to_none=True)
        with autocast_context(config.runtime, torch.device("cpu")):  # as speculators' Trainer does
            _, loss, _ = model(
                **batch, loss_config=loss_config, max_anchors=max_anchors,
                num_depths=cod.num_depths, down_sample_ratio=ratio,
                down_sample_ratio_min=cod.down_sample_ratio_min,
            )
        loss.backward()
        if opt.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(params, opt.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
        print(f"  [theirs] step {step + 1}/{total} loss {losses[-1]:.4f}", file=sys.stderr)
    train_s = time.perf_counter() - began
    draft = Path(spec["out"]) / SIDES["theirs"]
    save_atomically(model, draft)
    return {"steps": total, "train_s": train_s, "losses": losses, "draft": str(draft)}


def worker(side: str, spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    result = train_ours(spec) if side == "ours" else train_theirs(spec)
    result["peak_rss_gib"] = peak_rss_gib()
    print("RESULT " + json.dumps(result), flush=True)


def _speculators_max_anchors() -> int | None:
    """``speculators train``'s default cap on P-EAGLE chain starts."""
    from speculators.train.config.schema import DataArgs

    return DataArgs.model_fields["max_anchors"].default


def _speculators_down_sample_ratio() -> float:
    """``speculators train``'s default COD decay ratio r for P-EAGLE."""
    from speculators.train.config.schema import PEagleArgs

    return PEagleArgs.model_fields["down_sample_ratio"].default


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-dir", default="runs/demo")
    parser.add_argument("--out", default="runs/side-by-side")
    parser.add_argument("--steps", type=int, help="Optimizer steps [default: the demo's].")
    parser.add_argument("--eval-prompts", action="append", help="[default: the demo's].")
    parser.add_argument(
        "--seed", type=int, help="Initial weights, row order and COD samples [default: the YAML's]."
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--theirs-max-anchors", type=lambda t: None if t.lower() == "none" else int(t),
        default=_speculators_max_anchors(),
        help="speculators' COD chain cap; none = ours [default: speculators train's default].",
    )
    parser.add_argument(
        "--theirs-down-sample-ratio", type=lambda t: None if t.lower() == "none" else float(t),
        default=_speculators_down_sample_ratio(),
        help="speculators' COD decay ratio r; none = ours [default: speculators train's default].",
    )
    parser.add_argument(
        "--theirs-draft", choices=("ours", "speculators"), default="ours",
        help="theirs' initial draft: ours' (one draft for both), or the one speculators "
        "train builds (random layer, the verifier's key/value heads) [default: ours].",
    )
    parser.add_argument("--worker", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser.parse_args()


def _train_sides(spec: dict) -> dict:
    """Each side trained in its own fresh subprocess; ``{side: its RESULT record}``."""
    results = {}
    for side in ("ours", "theirs"):
        stdout = run_command([sys.executable, "-m", "eval.side_by_side", "--worker", side,
                       "--spec", json.dumps(spec)])
        line = next(ln for ln in stdout.splitlines() if ln.startswith("RESULT "))
        results[side] = json.loads(line[len("RESULT ") :])
    return results


def _print_table(results: dict, spec: dict, k: int, prompts: list[str]) -> None:
    ours, theirs = results["ours"], results["theirs"]
    print(f"\n{ours['steps']} optimizer steps each, {spec['threads']} threads; K={k}; "
          f"speculators' max_anchors {spec.get('theirs_max_anchors')}, "
          f"r {spec.get('theirs_down_sample_ratio') or 'ours'}, "
          f"initial draft {spec.get('theirs_draft', 'ours')}\n")
    print("| | ours (plugin) | speculators built-in | ours vs theirs |")
    print("|---|---:|---:|---:|")
    print(f"| training loop (s) | {ours['train_s']:.1f} | {theirs['train_s']:.1f} | "
          f"{theirs['train_s'] / ours['train_s']:.2f}x faster |")
    print(f"| peak RSS (GiB) | {ours['peak_rss_gib']:.2f} | {theirs['peak_rss_gib']:.2f} | "
          f"{ours['peak_rss_gib'] / theirs['peak_rss_gib']:.2f}x |")
    print(f"| final loss | {ours['losses'][-1]:.3f} | {theirs['losses'][-1]:.3f} | |")
    for p in prompts:
        a, b = ours["acceptance"][p], theirs["acceptance"][p]
        print(f"| acceptance length, {p} | {a['acceptance_length']:.3f} | "
              f"{b['acceptance_length']:.3f} | "
              f"{a['acceptance_length'] - b['acceptance_length']:+.3f} |")


def main() -> None:
    args = _parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.spec))
        return

    demo = demo_inputs(Path(args.demo_dir))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "target": demo["target"], "data": demo["data"], "config": demo["config"],
        "steps": args.steps or demo["steps_demo"],  # None: the YAML's epochs, as the demo
        "out": str(out), "threads": args.threads, "seed": args.seed,
        "theirs_max_anchors": args.theirs_max_anchors,
        "theirs_down_sample_ratio": args.theirs_down_sample_ratio,
        "theirs_draft": args.theirs_draft,
    }
    results = _train_sides(spec)
    prompts = args.eval_prompts or demo["eval_prompts"]
    eval_dir = out / "eval"
    drafts = [results[side]["draft"] for side in SIDES]
    served = served_acceptance(demo, drafts, prompts, eval_dir)
    for side in SIDES:
        results[side]["acceptance"] = served[results[side]["draft"]]
    summary = {
        "provenance": provenance(["python", "-m", "eval.side_by_side", *sys.argv[1:]]),
        "spec": spec,
        "results": results,
        "eval_record": str(eval_dir / "record.json"),
    }
    atomic_write_text(out / "side_by_side.json", json.dumps(summary, indent=1) + "\n")
    _print_table(results, spec, demo["k"], prompts)
    print(f"\nrecord: {out / 'side_by_side.json'}  plot: {eval_dir / 'acceptance.png'}")


if __name__ == "__main__":
    main()
