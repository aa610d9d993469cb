"""speculators' train keys as users type them: scheduler_warmup_ratio."""

import json
import logging
import shutil

import pytest
import torch
from helpers.training import run_cli, train_args

from speculators_peagle_plugin.training.optim import SchedulerConfig, build_scheduler
from speculators_peagle_plugin.training.progress import METRICS_FILE


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
