"""Validation while training: each checkpoint scored on held-out data, the best kept, early stop,
and a resumed run that continues with the same best and patience."""

import json
import os
import shutil
import signal

import pytest
from helpers.training import config_for, run_cli, train_args
from safetensors.torch import load_file

from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs
from speculators_peagle_plugin.training.heldout import heldout_metrics
from speculators_peagle_plugin.training.validation import BEST_DIR, VALIDATION_FILE


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("validation") / "workdir")


def records(save):
    return [json.loads(line) for line in (save / VALIDATION_FILE).read_text().splitlines()]


def test_every_checkpoint_is_scored_on_the_held_out_data_and_the_best_is_kept(workdir, tmp_path):
    save = tmp_path / "run"
    code, out = run_cli(train_args(workdir, save, "--epochs", "2", "--checkpoint-freq", "0.5",
                                   "--keep-checkpoints", "10",
                                   "--validation-data-path", str(workdir / "data")))
    assert code == 0, out
    checkpoints = checkpoint_dirs(save)
    found = records(save)
    assert [r["checkpoint"] for r in found] == [c.name for c in checkpoints]
    config = config_for(workdir, tmp_path / "unused")
    for record, checkpoint in zip(found, checkpoints, strict=True):  # the oracle: scored again
        again = heldout_metrics(checkpoint, config, workdir / "data")
        assert record["acceptance_length"] == pytest.approx(again["acceptance_length"])
    best = max(found, key=lambda r: r["acceptance_length"])
    kept = load_file(save / BEST_DIR / "model.safetensors")
    for name, tensor in load_file(save / best["checkpoint"] / "model.safetensors").items():
        assert kept[name].equal(tensor)
    card = (save / BEST_DIR / "README.md").read_text()  # the model card serves best/ itself
    assert f'"model": "{BEST_DIR}"' in card and str(tmp_path) not in card  # no local path


def scripted(monkeypatch, acceptances):
    """heldout_metrics returning ``acceptances`` in turn (one per scored checkpoint)."""
    calls = []

    def fake(checkpoint, config, data_path, *, seed=0, samples=None):
        calls.append(checkpoint.name)
        return {"loss": 1.0, "accuracy_per_depth": [0.5], "supervised": [1],
                "acceptance_length": acceptances[len(calls) - 1]}

    monkeypatch.setattr("speculators_peagle_plugin.training.heldout.heldout_metrics", fake)
    return calls


def test_training_stops_after_patience_checkpoints_without_a_better_one(
    workdir, tmp_path, monkeypatch
):
    save = tmp_path / "run"
    args = train_args(workdir, save, "--epochs", "10", "--checkpoint-freq", "0.5",
                      "--keep-checkpoints", "10", "--validation-data-path", str(workdir / "data"),
                      "--early-stop-patience", "2")
    calls = scripted(monkeypatch, [1.2, 1.4, 1.3, 1.4, 1.1, 2.0])
    code, out = run_cli(args)
    assert code == 0, out
    assert len(calls) == 4  # 1.4 at the second checkpoint, then two that do not beat it
    assert [r["acceptance_length"] for r in records(save)] == [1.2, 1.4, 1.3, 1.4]
    best = load_file(save / BEST_DIR / "model.safetensors")
    second = load_file(checkpoint_dirs(save)[1] / "model.safetensors")
    assert all(best[k].equal(v) for k, v in second.items())
    # the same command again: the run stopped; nothing is trained or scored
    code, out = run_cli(args)
    assert code == 0, out
    assert len(calls) == 4 and len(checkpoint_dirs(save)) == 4


def test_a_resumed_run_continues_with_the_same_best_and_patience(workdir, tmp_path, monkeypatch):
    save = tmp_path / "run"
    common = ("--epochs", "10", "--checkpoint-freq", "0.5", "--keep-checkpoints", "10",
              "--validation-data-path", str(workdir / "data"), "--early-stop-patience", "2")
    scripted(monkeypatch, [1.2, 1.4, 1.3, 1.25, 9.0])
    code, out = run_cli(train_args(workdir, save, *common, "--max-steps", "1000"))
    assert code == 0, out
    stopped = records(save)
    assert [r["acceptance_length"] for r in stopped] == [1.2, 1.4, 1.3, 1.25]
    per_checkpoint = stopped[1]["step"] - stopped[0]["step"]
    # a run killed after its third checkpoint (its fourth record and checkpoint never written)
    # resumes from the third: scores its fourth again and stops there
    shutil.rmtree(checkpoint_dirs(save)[-1])
    scripted_again = scripted(monkeypatch, [1.25])
    code, out = run_cli(train_args(workdir, save, *common, "--max-steps", "1000"))
    assert code == 0, out
    assert [r["acceptance_length"] for r in records(save)] == [1.2, 1.4, 1.3, 1.25]
    assert len(scripted_again) == 1 and records(save)[-1]["step"] == 4 * per_checkpoint


def test_a_run_stopped_off_the_checkpoint_grid_scores_what_an_uninterrupted_run_scores(
    workdir, tmp_path, monkeypatch
):
    """SIGTERM between two checkpoints of the grid saves where the run stopped; the resumed
    run leaves that checkpoint unscored, so its records (its best, its patience count) are
    the uninterrupted run's, figure for figure (training resumes exactly)."""
    from speculators_peagle_plugin.training import loop

    common = ("--epochs", "2", "--checkpoint-freq", "0.5", "--keep-checkpoints", "10",
              "--validation-data-path", str(workdir / "data"), "--early-stop-patience", "3")
    code, out = run_cli(train_args(workdir, tmp_path / "straight", *common))
    assert code == 0, out
    straight = records(tmp_path / "straight")
    per_checkpoint = straight[0]["step"]
    assert per_checkpoint >= 3 and len(straight) == 4  # room for a step off the grid

    def record_then_sigterm(path, record, append=loop.append_record):
        append(path, record)
        if "cut" in str(path) and record["step"] == per_checkpoint + 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "append_record", record_then_sigterm)
    cut = tmp_path / "cut"
    code, out = run_cli(train_args(workdir, cut, *common))
    assert code == 128 + signal.SIGTERM, out
    stopped_at = int(checkpoint_dirs(cut)[-1].name.split("-")[1])
    assert stopped_at % per_checkpoint != 0, stopped_at
    code, out = run_cli(train_args(workdir, cut, *common))
    assert code == 0, out
    resumed = records(cut)
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]
    assert [r["acceptance_length"] for r in resumed] == [r["acceptance_length"] for r in straight]


def test_early_stop_needs_validation_data(workdir, tmp_path):
    code, out = run_cli(train_args(workdir, tmp_path / "run", "--early-stop-patience", "2"))
    assert code != 0
    assert "early_stop_patience needs validation_data_path" in out
    assert len(out.strip().splitlines()) == 1
