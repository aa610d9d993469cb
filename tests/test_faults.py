"""Faults a run survives (issue 59): each ends in one sentence, loses nothing, and the same
command afterwards finishes with the result of an uninterrupted run.
``docs/bad_input.md`` lists each fault and its test."""

import errno
import json
import logging

import pytest
import safetensors.torch
import torch
from helpers.training import DRAFT_VOCAB, refusal, run_cli, train_args
from tiny import tiny_workdir

from speculators_peagle_plugin.common.reading import load_safetensors
from speculators_peagle_plugin.training import progress
from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs

# ------------------------------------------------------------------ disk faults
# A full disk is injected where the bytes are written: the writer raises ENOSPC (or, as
# safetensors does, its own error type in ENOSPC's words) after writing part of its bytes.

# a checkpoint after every step, all kept
STEPS = ("--max-steps", "3", "--checkpoint-freq", "0.01", "--keep-checkpoints", "3")
NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tiny_workdir(tmp_path_factory.mktemp("faults"), DRAFT_VOCAB)


@pytest.fixture(scope="module")
def uninterrupted(workdir, tmp_path_factory):
    """The save path of the same run with room to spare."""
    save = tmp_path_factory.mktemp("uninterrupted") / "save"
    code, out = run_cli(train_args(workdir, save, *STEPS))
    assert code == 0, out
    return save


def weights(checkpoint):
    return load_safetensors(checkpoint / "model.safetensors")


def assert_same_weights(checkpoint, expected):
    got, want = weights(checkpoint), weights(expected)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), checkpoint


def finishes_like(workdir, save, uninterrupted, *extra):
    """The same command, on a disk with room again, ends where the uninterrupted run did."""
    code, out = run_cli(train_args(workdir, save, *STEPS, *extra))
    assert code == 0, out
    assert [p.name for p in checkpoint_dirs(save)] == [f"checkpoint-{n}" for n in (1, 2, 3)]
    for checkpoint in checkpoint_dirs(save):
        assert_same_weights(checkpoint, uninterrupted / checkpoint.name)
    lines = (save / progress.METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def fill_on_call(n, write_part, error):
    """A writer that writes part of its bytes and raises ``error`` on its ``n``-th call."""
    calls = []

    def writer(real):
        def write(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                write_part(*args)
                raise error
            return real(*args, **kwargs)
        return write
    return writer


def test_a_disk_that_fills_during_a_checkpoint_keeps_the_previous_one_and_resumes(
    workdir, uninterrupted, tmp_path, monkeypatch
):
    import transformers.modeling_utils as modeling_utils

    def half_file(tensors, filename, *rest):
        with open(filename, "wb") as fh:
            fh.write(b"\0" * 1000)

    # safetensors' own error type, as the issue's traceback showed it
    error = safetensors.SafetensorError(f"I/O error: {NO_SPACE} (os error 28)")
    writer = fill_on_call(2, half_file, error)
    monkeypatch.setattr(modeling_utils, "safe_save_file", writer(modeling_utils.safe_save_file))
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, *STEPS)))
    assert f"Writing {save / 'checkpoint-2'} failed, no space left on the device: " in line
    assert "a checkpoint needs about" in line and "run the same command again" in line
    assert [p.name for p in checkpoint_dirs(save)] == ["checkpoint-1"]
    assert not list(save.glob(".*.tmp-*"))
    assert_same_weights(save / "checkpoint-1", uninterrupted / "checkpoint-1")
    monkeypatch.undo()
    finishes_like(workdir, save, uninterrupted)


def test_a_disk_that_fills_while_the_training_state_is_written_is_one_sentence(
    workdir, uninterrupted, tmp_path, monkeypatch
):
    def half_file(state, path):
        path.write_bytes(b"PK" + b"\0" * 100)

    writer = fill_on_call(3, half_file, OSError(errno.ENOSPC, NO_SPACE))
    monkeypatch.setattr(torch, "save", writer(torch.save))
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, *STEPS)))
    assert f"Writing {save / 'checkpoint-3'} failed, no space left on the device" in line
    assert [p.name for p in checkpoint_dirs(save)] == ["checkpoint-1", "checkpoint-2"]
    monkeypatch.undo()
    finishes_like(workdir, save, uninterrupted)


class CutShort:
    """A file whose ``n``-th write puts half its text down and raises ENOSPC."""

    def __init__(self, fh, fail):
        self.fh, self.fail = fh, fail

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def write(self, text):
        if self.fail():
            self.fh.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, NO_SPACE)
        return self.fh.write(text)


def test_a_disk_that_fills_while_the_metrics_log_is_written_resumes_to_the_same_run(
    workdir, uninterrupted, tmp_path, monkeypatch
):
    calls = []

    def cut_on_second(path, mode="r", **kwargs):
        calls.append(1)
        return CutShort(open(path, mode, **kwargs), lambda: len(calls) == 2)

    monkeypatch.setattr(progress, "open", cut_on_second, raising=False)
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, *STEPS)))
    metrics = save / progress.METRICS_FILE
    assert f"Writing {metrics} failed, no space left on the device: a metrics line" in line
    assert [p.name for p in checkpoint_dirs(save)] == ["checkpoint-1"]
    monkeypatch.undo()
    finishes_like(workdir, save, uninterrupted)


class FullDiskHandler(logging.Handler):
    """A tracker's handler whose disk fills at its second record."""

    def __init__(self):
        super().__init__()
        self.records = 0

    def emit(self, record):
        self.records += 1
        if self.records == 3:  # the hyperparameters, step 1, then step 2
            raise OSError(errno.ENOSPC, NO_SPACE, "events.out.tfevents")


def test_a_disk_that_fills_while_a_tracker_writes_is_one_sentence(
    workdir, uninterrupted, tmp_path, monkeypatch
):
    import speculators.train.logger as speculators_logger

    def setup(names, run_name, log_dir):  # as speculators' own does, with one handler
        metrics = logging.getLogger("speculators.metrics")
        metrics.setLevel(logging.INFO)
        metrics.addHandler(FullDiskHandler())

    monkeypatch.setattr(speculators_logger, "setup_metric_logger", setup)
    save, logs = tmp_path / "save", tmp_path / "logs"
    trackers = ("--logger", "tensorboard", "--log-dir", str(logs))
    line = refusal(*run_cli(train_args(workdir, save, *STEPS, *trackers)))
    assert f"Writing {logs} failed, no space left on the device" in line
    assert "the trackers' records" in line
    assert [p.name for p in checkpoint_dirs(save)] == ["checkpoint-1"]
    assert not logging.getLogger("speculators.metrics").handlers  # closed on the way out
    monkeypatch.undo()
    finishes_like(workdir, save, uninterrupted, *trackers)


def test_a_save_path_without_room_for_a_checkpoint_is_refused_before_training(
    workdir, tmp_path, monkeypatch
):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, *STEPS)))
    assert f"--save-path {save} needs about" in line
    assert "for a checkpoint but its disk has 4.0 KiB free" in line
    assert not checkpoint_dirs(save) and not (save / progress.METRICS_FILE).exists()
