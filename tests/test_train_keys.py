"""speculators' train keys as users type them: scheduler_warmup_ratio, from_pretrained (our
checkpoint or speculators' save_pretrained output), train_data_ratio's held-out split and
save_best."""

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
from speculators_peagle_plugin.training.checkpoint import CHECKPOINT_PREFIX, checkpoint_dirs
from speculators_peagle_plugin.training.heldout import heldout_metrics
from speculators_peagle_plugin.training.loop import build_training
from speculators_peagle_plugin.training.optim import SchedulerConfig, build_scheduler
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.validation import BEST_DIR, VALIDATION_FILE

# A checkpoint every 2 steps: the tiny data packs into 10 rows of 96 tokens an epoch, its
# 0.75 training share (12 samples) into 7.
EVERY_2 = ("--epochs", "100", "--checkpoint-freq", "0.2", "--keep-checkpoints", "10")
SPLIT_EVERY_2 = ("--epochs", "100", "--checkpoint-freq", "0.3", "--keep-checkpoints", "10",
                 "--train-data-ratio", "0.75")


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("keys") / "workdir")


@pytest.fixture(scope="module")
def trained(workdir, tmp_path_factory):
    """A checkpoint of ours after two steps."""
    save = tmp_path_factory.mktemp("pretrained")
    code, out = run_cli(train_args(workdir, save, "--max-steps", "2"))
    assert code == 0, out
    return checkpoint_dirs(save)[-1]


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
                                              (1.0, 8)])
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
                             scheduler_warmup_ratio=0.5)
    with caplog.at_level(logging.WARNING):
        assert warmup_of(lr_curve(config, 20)) == 3
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "using scheduler_warmup_steps" in warning and "\n" not in warning


def test_a_run_warms_up_over_its_ratio_of_the_steps(workdir, tmp_path):
    code, out = run_cli(train_args(workdir, tmp_path, "--max-steps", "8", "--epochs", "100",
                                   "--scheduler-type", "none",
                                   "--scheduler-warmup-ratio", "0.5"))
    assert code == 0, out
    lrs = [r["lr"] for r in lines(tmp_path / METRICS_FILE)]  # after steps 1..8
    assert lrs == pytest.approx([0.01 * min(1, s / 4) for s in range(1, 9)])  # warmup 4


# ------------------------------------------------------------------ from_pretrained


def speculators_copy(checkpoint, target, dest):
    """``checkpoint`` loaded by speculators' own class, its weights moved, and saved by its
    ``save_pretrained``: a draft in speculators' format that differs from ours."""
    from speculators.model import SpeculatorModel
    from speculators.models.peagle import PEagleDraftModel as SpeculatorsPEagle

    theirs = SpeculatorModel.from_pretrained(checkpoint, verifier=str(target))
    assert type(theirs) is SpeculatorsPEagle
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    theirs.save_pretrained(dest)
    return dest


@pytest.mark.parametrize("source", ["ours", "speculators"])
def test_a_run_from_pretrained_starts_from_its_weights_at_step_0(
    workdir, trained, tmp_path, source
):
    path = trained
    if source == "speculators":
        path = speculators_copy(trained, workdir / "target", tmp_path / "theirs")
    saved = load_file(path / "model.safetensors")
    save = tmp_path / "run"
    setup = build_training(config_for(workdir, save, from_pretrained=str(path)), save)
    state = setup.draft.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    fresh = build_training(config_for(workdir, tmp_path / "fresh")).draft.state_dict()
    assert not torch.equal(fresh["mask_hidden"], saved["mask_hidden"])  # equal by loading
    assert setup.resume is None and not any(o.state for o in setup.optimizers)
    assert [s.last_epoch for s in setup.schedulers] == [0]
    args = train_args(workdir, save, "--max-steps", "2", "--from-pretrained", str(path))
    code, out = run_cli(args)
    assert code == 0, out
    assert [r["step"] for r in lines(save / METRICS_FILE)] == [1, 2]
    assert [c.name for c in checkpoint_dirs(save)] == [f"{CHECKPOINT_PREFIX}2"]


def config_only(tmp_path, trained, kind="peagle"):
    path = tmp_path / f"config-{kind}"
    path.mkdir()
    config = json.loads((trained / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "speculators_model_type": kind}))
    return path


def test_a_draft_that_does_not_fit_the_run_is_one_sentence(workdir, trained, tmp_path):
    save = tmp_path / "run"

    def answer(path, *extra):
        return refused(workdir, save, workdir / "data", "--from-pretrained", str(path), *extra)

    line = answer(trained, "--num-layers", "2")
    assert "does not fit this run: its draft layers 1, this run's 2 (--num-layers);" in line
    line = answer(trained, "--target-layer-ids", "2,3")
    assert "its aux layer ids [1, 2, 3], this run's [2, 3] (--target-layer-ids)" in line
    line = answer(trained, "--num-key-value-heads", "4")
    assert "its layers.0.self_attn.k_proj.weight is [32, 128], this run's [64, 128]" in line
    mask = json.loads((trained / "config.json").read_text())["mask_token_id"]
    line = answer(trained, "--mask-token-id", str(mask - 1))
    assert f"differs from the mask token {mask} that --from-pretrained {trained}" in line
    assert "is not a draft directory (no config.json)" in answer(tmp_path / "missing")
    assert "holds no weights" in answer(config_only(tmp_path, trained))
    line = answer(config_only(tmp_path, trained, "eagle3"))
    assert "is a eagle3 draft" in line and "only a P-EAGLE draft" in line
    for line in (answer(trained, "--num-layers", "2"), answer(tmp_path / "missing")):
        assert line.startswith("Error: ") and line.count(". ") == 0


def test_a_run_from_pretrained_resumes_from_its_own_checkpoint(workdir, trained, tmp_path):
    pretrained = shutil.copytree(trained, tmp_path / "pretrained")
    args = ("--max-steps", "4", *EVERY_2, "--from-pretrained", str(pretrained))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    code, out = run_cli(train_args(workdir, straight, *args))
    assert code == 0, out
    assert [c.name for c in checkpoint_dirs(straight)] == ["checkpoint-2", "checkpoint-4"]
    shutil.copytree(straight, killed)  # as a run killed after its second step left it
    shutil.rmtree(killed / "checkpoint-4")
    shutil.rmtree(pretrained)  # resuming reads its checkpoint, not the pretrained draft
    code, out = run_cli(train_args(workdir, killed, *args))
    assert code == 0, out
    assert [r["step"] for r in lines(killed / METRICS_FILE)] == [1, 2, 3, 4]
    a = load_file(straight / "checkpoint-4" / "model.safetensors")
    b = load_file(killed / "checkpoint-4" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
                   for r in range(world_size)]
        for epoch in range(3):
            packed = [i for b in batches for s in range(len(b))
                      for i in b.step_samples(epoch, s)]
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
                                   "--no-save-best"))
    assert code == 0, out
    assert [r["step"] for r in lines(save / VALIDATION_FILE)] == [2, 4]
    assert not (save / BEST_DIR).exists()
    assert f"final checkpoint: {save / 'checkpoint-4'}" in out
