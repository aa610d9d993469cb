"""Running ``speculators-peagle train`` on the tiny work directory (``tiny.tiny_workdir``)."""

from __future__ import annotations

from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.training.config import TrainConfig

DRAFT_VOCAB = 40


def train_args(workdir, save, *extra):
    return [
        "train", "--verifier-name-or-path", str(workdir / "target"),
        "--data-path", str(workdir / "data"), "--save-path", str(save),
        "--draft-vocab-size", str(DRAFT_VOCAB), "--num-depths", "3", "--total-seq-len", "96",
        "--seed", "3", "--lr", "0.01", *extra,
    ]  # fmt: skip


def config_for(workdir, save, **kw):
    defaults = {"verifier_name_or_path": str(workdir / "target"),
                "data_path": str(workdir / "data"), "seed": 3, "lr": 0.01}  # fmt: skip
    return TrainConfig(
        save_path=str(save), draft_vocab_size=DRAFT_VOCAB, num_depths=3, total_seq_len=96,
        **(defaults | kw),
    )  # fmt: skip


def run_cli(args):
    """``(exit code, output)`` of the command line run in this process."""
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def refused(workdir, save, data, *extra):
    """The last output line of a one-step ``train`` on ``data`` that must exit 1 and leave no
    checkpoint in ``save``."""
    args = train_args(workdir, save, "--max-steps", "1", *extra)
    args[args.index("--data-path") + 1] = str(data)
    code, out = run_cli(args)
    assert code == 1, out
    assert not save.exists() or not any(save.iterdir()), "a partial checkpoint was left"
    return out.strip().splitlines()[-1]
