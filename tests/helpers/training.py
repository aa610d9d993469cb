"""Running ``speculators-peagle train`` on the tiny work directory (``tiny.tiny_workdir``)."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data import PackedBatches
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.step import cod_generator
from speculators_peagle_plugin.training.train_config import TrainConfig

DRAFT_VOCAB = 40


def train_args(workdir, save, *extra):
    return [
        "train", "--verifier-name-or-path", str(workdir / "target"),
        "--data-path", str(workdir / "data"), "--save-path", str(save),
        "--draft-vocab-size", str(DRAFT_VOCAB), "--num-depths", "3", "--total-seq-len", "96",
        "--seed", "3", "--lr", "0.01", "--optimizer", "adamw", *extra,
    ]


def config_for(workdir, save, **kw):
    defaults = {"verifier_name_or_path": str(workdir / "target"),
                "data_path": str(workdir / "data"), "seed": 3, "lr": 0.01,
                "total_seq_len": 96, "optimizer": "adamw"}
    return TrainConfig.from_sources(
        save_path=str(save), draft_vocab_size=DRAFT_VOCAB, num_depths=3, **(defaults | kw)
    )


def run_cli(args):
    """``(exit code, output)`` of the command line run in this process."""
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def train_ok(workdir, save, *extra):
    """``save`` after a ``train`` (``train_args``) that must exit 0."""
    code, out = run_cli(train_args(workdir, save, *extra))
    assert code == 0, out
    return save


def refusal(code, out):
    """The one-line error of a refused command."""
    assert code == 1, out
    assert "Traceback" not in out
    line = out.strip().splitlines()[-1]
    assert line.startswith("Error: "), out
    return line


def reference_step(workdir, save, partitions, world_size=2, **kw):
    """One optimizer step in this process on the global batch of ``world_size`` rows:
    the mean of the rows' losses, each row's COD drawn as that rank draws it. ``kw``: more
    TrainConfig settings."""
    config = config_for(workdir, save, sequence_partitions=partitions, max_steps=1, **kw)
    setup = build_training(config)
    rows = PackedBatches(
        setup.batches.data, config.data.total_seq_len, seed=config.seed, rank=0,
        world_size=world_size,
    ).global_rows(0, 0)
    module = setup.module
    setup.optimizers.zero_grad()
    for rank, row in enumerate(rows):
        module.generator = cod_generator(config.seed, 0, rank, torch.device("cpu"))
        if partitions == 1:
            (module.forward_batch(row).loss / world_size).backward()
            continue
        plan = module.build_peagle_plan(row["loss_mask"], document_ids=row["document_ids"])
        for i in range(len(plan)):
            (module.forward_batch(row, peagle_segment=(plan, i)).loss / world_size).backward()
    torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 1.0)
    setup.optimizers.step()
    return {k: v.detach() for k, v in setup.draft.state_dict().items()}


def refused(workdir, save, data, *extra):
    """The last output line of a one-step ``train`` on ``data`` that must exit 1 and leave no
    checkpoint in ``save``."""
    args = train_args(workdir, save, "--max-steps", "1", *extra)
    args[args.index("--data-path") + 1] = str(data)
    code, out = run_cli(args)
    assert code == 1, out
    assert not save.exists() or not any(save.iterdir()), "a partial checkpoint was left"
    return out.strip().splitlines()[-1]
