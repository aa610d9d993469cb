"""``train --logger``: speculators' metric trackers get what the metrics log holds."""

import json
import logging
import shutil

import pytest
from helpers.training import run_cli, train_args

from speculators_peagle_plugin.training import trackers
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.trackers import LoggingConfig
from speculators_peagle_plugin.training.validation import VALIDATION_FILE


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("trackers") / "workdir")


def scalars(log_dir):
    """``{tag: {step: value}}`` of every TensorBoard event file under ``log_dir``, read
    back with tensorboard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_tensorboard_event_files_hold_the_metrics_log(workdir, tmp_path):
    """Every step's loss, accuracies, estimated acceptance, lr, grad norm and tokens/s, and
    every validation record, equal what SAVE/metrics.jsonl and validation.jsonl hold
    (float32 in the event file); the handlers are closed when train returns."""
    logs = tmp_path / "logs"
    code, out = run_cli(train_args(
        workdir, tmp_path / "save", "--max-steps", "6", "--checkpoint-freq", "0.3",
        "--validation-data-path", str(workdir / "data"), "--logger", "tensorboard",
        "--log-dir", str(logs), "--run-name", "run-{rank}",
    ))
    assert code == 0, out
    assert (logs / "run-0").is_dir()
    got = scalars(logs)
    records = [json.loads(x) for x in (tmp_path / "save" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        for key in trackers.STEP_KEYS:
            assert got[f"train/{key}"][r["step"]] == pytest.approx(r[key], rel=1e-6), key
        for k, acc in enumerate(r["accuracy_per_depth"]):
            assert got[f"train/accuracy_depth/{k}"][r["step"]] == pytest.approx(acc, rel=1e-6)
    held = [json.loads(x) for x in (tmp_path / "save" / VALIDATION_FILE).read_text().splitlines()]
    assert len(held) >= 2
    assert sorted(got["val/acceptance_length"]) == [r["step"] for r in held]
    for r in held:
        assert got["val/loss"][r["step"]] == pytest.approx(r["loss"], rel=1e-6)
        assert got["val/acceptance_length"][r["step"]] == pytest.approx(
            r["acceptance_length"], rel=1e-6
        )
    metrics_logger = logging.getLogger(trackers.METRICS_LOGGER)
    assert metrics_logger.handlers == [] and metrics_logger.propagate


def test_without_logger_no_tracker_file_is_written(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_cli(train_args(workdir, tmp_path / "save", "--max-steps", "1"))
    assert code == 0, out
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(("value", "message"), [
    ("tensorbord", "logger must be a comma-separated list of tensorboard, wandb, trackio, "
                   "mlflow, got 'tensorbord'."),
    ("tensorboard,,comet", "logger must be a comma-separated list of"),
])
def test_unknown_tracker_is_one_sentence(value, message):
    with pytest.raises(ValueError, match=message):
        LoggingConfig(logger=value)


def test_tracker_without_its_package_is_one_sentence_before_training(workdir, tmp_path,
                                                                     monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real(name))
    code, out = run_cli(train_args(workdir, tmp_path / "save", "--max-steps", "1",
                                   "--logger", "tensorboard,wandb"))
    assert code == 1
    assert out.strip().splitlines()[-1] == (
        "Error: --logger wandb needs the wandb package, which is not installed "
        "(pip install wandb), or leave wandb out of --logger."
    )
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())
