"""speculators' train keys as users type them: scheduler_warmup_ratio, train_data_ratio's
held-out split and save_best."""

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers.training import config_for, refused, run_cli, train_args
from safetensors.torch import load_file

from speculators_peagle_plugin.data import PackedBatches, open_training_data, split_samples
from speculators_peagle_plugin.data.layout import HIDDEN_STATES_DIR, hs_path
from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs
from speculators_peagle_plugin.training.heldout import heldout_metrics
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.optim import SchedulerConfig, build_scheduler
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.validation import BEST_DIR, VALIDATION_FILE

# A checkpoint every 2 steps: the tiny data's 0.75 training share (12 samples) packs into 7
# rows of 96 tokens an epoch.
SPLIT_EVERY_2 = ("--epochs", "100", "--checkpoint-freq", "0.3", "--keep-checkpoints", "10",
                 "--train-data-ratio", "0.75")  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("keys") / "workdir")


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------ scheduler_warmup_ratio


def lr_curve(config: SchedulerConfig, total: int) -> list[float]:
    """The learning rate before each of ``total`` steps and after the last, peak lr 1."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, config, total)
    curve = [scheduler.get_last_lr()[0]]
    for _ in range(total):
        optimizer.step()
        scheduler.step()
        curve.append(scheduler.get_last_lr()[0])
    return curve


def warmup_of(curve: list[float]) -> int:
    """Warmup read back from a constant-after-warmup curve: the first step at the peak."""
    return next(step for step, lr in enumerate(curve) if lr == pytest.approx(1.0, abs=1e-12))


@pytest.mark.parametrize(("ratio", "total"), [(0.25, 40), (0.35, 10), (0.3, 7), (0.0, 20),
                                              (1.0, 8)])  # fmt: skip
def test_the_warmup_ratio_gives_speculators_warmup(ratio, total):
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps

    config = SchedulerConfig(scheduler_type="none", scheduler_warmup_ratio=ratio)
    theirs = TrainerConfig(lr=1.0, num_epochs=1, save_path="unused", scheduler_warmup_ratio=ratio)
    want, _ = _resolve_scheduler_steps(theirs, total)  # the oracle: speculators' own rule
    assert warmup_of(lr_curve(config, total)) == want
    linear = lr_curve(SchedulerConfig(scheduler_warmup_ratio=ratio), total)[:total]
    rising = [a < b for a, b in zip(linear, linear[1:], strict=False)]  # then it decays
    assert all(rising[:want]) and not any(rising[want:])


def test_warmup_steps_beside_a_ratio_win_with_one_warning_line(caplog):
    config = SchedulerConfig(scheduler_type="none", scheduler_warmup_steps=3,
                             scheduler_warmup_ratio=0.5)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert warmup_of(lr_curve(config, 20)) == 3
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "using scheduler_warmup_steps" in warning and "\n" not in warning


def test_a_run_warms_up_over_its_ratio_of_the_steps(workdir, tmp_path):
    code, out = run_cli(train_args(workdir, tmp_path, "--max-steps", "8", "--epochs", "100",
                                   "--scheduler-type", "none",
                                   "--scheduler-warmup-ratio", "0.5"))  # fmt: skip
    assert code == 0, out
    lrs = [r["lr"] for r in lines(tmp_path / METRICS_FILE)]  # after steps 1..8
    assert lrs == pytest.approx([0.01 * min(1, s / 4) for s in range(1, 9)])  # warmup 4


# ------------------------------------------------------------------ train_data_ratio, save_best


@pytest.mark.parametrize(("n", "ratio"), [(16, 0.75), (16, 0.5), (7, 0.9), (100, 0.33)])
def test_the_split_is_seeded_disjoint_and_covers_every_sample(n, ratio):
    data = SimpleNamespace(num_samples=n, path="DATA")  # what the split reads of a dataset
    held_outs = set()
    for seed in range(20):
        train, held = split_samples(data, ratio, seed)
        assert (train, held) == split_samples(data, ratio, seed)
        assert len(train) == round(ratio * n) and not set(train) & set(held)
        assert sorted(train + held) == list(range(n))
        held_outs.add(held)
    assert len(held_outs) > 1  # the seed chooses the rows
    assert split_samples(data, 1.0, 0) == (tuple(range(n)), ())


def test_packed_rows_hold_the_training_samples_once_per_epoch_on_every_rank(workdir):
    data = open_training_data(workdir / "data")
    train, held = split_samples(data, 0.75, 3)
    for world_size in (1, 2):
        batches = [PackedBatches(data, 96, seed=3, samples=train, rank=r, world_size=world_size)
                   for r in range(world_size)]  # fmt: skip
        for epoch in range(3):
            packed = [i for b in batches for s in range(len(b))
                      for i in b.step_samples(epoch, s)]  # fmt: skip
            assert sorted(packed) == list(train)


def test_a_split_with_an_empty_side_is_one_sentence(workdir, tmp_path):
    for ratio, empty in (("0.01", "no training sample"), ("0.99", "no held-out sample")):
        line = refused(workdir, tmp_path / "run", workdir / "data", "--train-data-ratio", ratio)
        assert f"train_data_ratio {ratio} of the 16 samples in" in line and empty in line


def copy_samples(data_dir, samples, dest):
    """A data directory holding only ``samples`` of ``data_dir``, in that order: the oracle
    for scoring a subset of a directory in place."""
    from datasets import load_from_disk

    (dest / HIDDEN_STATES_DIR).mkdir(parents=True)
    load_from_disk(str(data_dir)).select(list(samples)).save_to_disk(str(dest / "rows"))
    for item in (dest / "rows").iterdir():
        item.rename(dest / item.name)
    for name in ("generation_settings.json", "token_freq.pt"):
        shutil.copy2(data_dir / name, dest / name)
    for j, i in enumerate(samples):
        shutil.copy2(hs_path(data_dir / HIDDEN_STATES_DIR, i), hs_path(dest / HIDDEN_STATES_DIR, j))
    return dest


def test_held_out_rows_are_scored_like_validation_data_and_the_best_kept(workdir, tmp_path):
    save = tmp_path / "run"
    code, out = run_cli(train_args(workdir, save, "--max-steps", "4", *SPLIT_EVERY_2))
    assert code == 0, out
    records = lines(save / VALIDATION_FILE)
    checkpoints = checkpoint_dirs(save)
    assert [r["checkpoint"] for r in records] == [c.name for c in checkpoints]
    config = config_for(workdir, tmp_path / "unused", train_data_ratio=0.75)
    train, held = split_samples(open_training_data(workdir / "data"), 0.75, config.seed)
    held_out_data = copy_samples(workdir / "data", held, tmp_path / "held-out")
    for record, checkpoint in zip(records, checkpoints, strict=True):
        again = heldout_metrics(checkpoint, config, held_out_data)
        assert {k: record[k] for k in again} == again  # the same computation, bit for bit
        assert again["supervised"][0] > 0
    best = max(records, key=lambda r: r["acceptance_length"])
    kept = load_file(save / BEST_DIR / "model.safetensors")
    chosen = load_file(save / best["checkpoint"] / "model.safetensors")
    assert all(kept[k].equal(v) for k, v in chosen.items())
    assert f"final checkpoint: {save / BEST_DIR}" in out
    setup = build_training(config)  # training never sees a held-out row
    assert setup.heldout_samples == held
    for epoch in range(3):
        rows = setup.batches.rows(epoch)
        assert sorted(i for row in rows for i in row) == list(train)


def test_save_best_false_scores_every_checkpoint_and_keeps_no_best(workdir, tmp_path):
    save = tmp_path / "run"
    code, out = run_cli(train_args(workdir, save, "--max-steps", "4", *SPLIT_EVERY_2,
                                   "--no-save-best"))  # fmt: skip
    assert code == 0, out
    assert [r["step"] for r in lines(save / VALIDATION_FILE)] == [2, 4]
    assert not (save / BEST_DIR).exists()
    assert f"final checkpoint: {save / 'checkpoint-4'}" in out
