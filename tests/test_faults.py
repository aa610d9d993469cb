"""Faults a run survives (issue 59): each ends in one sentence, loses nothing, and the same
command afterwards finishes with the result of an uninterrupted run.
``docs/bad_input.md`` lists each fault and its test; SIGKILL at random points is in
``test_faults_killed.py``."""

import errno
import json
import logging
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.results import data_rows, eval_args, eval_table, save_tiny_draft
from helpers.training import DRAFT_VOCAB, refusal, run_cli, train_args, train_ok
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
    return train_ok(workdir, tmp_path_factory.mktemp("uninterrupted") / "save", *STEPS)


def weights(checkpoint):
    return load_safetensors(checkpoint / "model.safetensors")


def assert_same_weights(checkpoint, expected):
    got, want = weights(checkpoint), weights(expected)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), checkpoint


def finishes_like(workdir, save, uninterrupted, *extra):
    """The same command, on a disk with room again, ends where the uninterrupted run did."""
    train_ok(workdir, save, *STEPS, *extra)
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


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return save_tiny_draft(target, tmp_path_factory.mktemp("draft") / "draft")


# ------------------------------------------------------------------ a server that dies
# eval --server against a fake vLLM server process (helpers.fake_vllm) that kills itself
# with SIGKILL halfway through the stream of a chosen request.


def served_eval(target, url, out):
    """eval of 2 prompt sets x concurrency 1, 2 on the server at ``url``: 4 cells, in turn
    (c=1 a, c=1 b, c=2 a, c=2 b) of 1, 1, 2 and 2 requests."""
    from click.testing import CliRunner

    from speculators_peagle_plugin.cli import main

    args = ["eval", "--target", target, "--server", url, "--prompts", "chat[:2]",
            "--prompts", "chat[2:4]", "--prompts-per-slot", "1", "--concurrency", "1,2",
            "--max-new-tokens", "6", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def test_a_server_that_dies_mid_eval_is_retried_then_one_sentence_and_the_rerun_resumes(
    target, tmp_path, monkeypatch
):
    from helpers.fake_vllm import fake_vllm
    from helpers.serve import free_port

    from speculators_peagle_plugin.evaluation import server as server_mod
    from speculators_peagle_plugin.evaluation.cells import CELLS_FILE

    monkeypatch.setattr(server_mod, "RETRY_WAIT_S", 0.05)
    port, log = free_port(), tmp_path / "requests.jsonl"
    url, out = f"http://127.0.0.1:{port}", tmp_path / "out"
    with fake_vllm(port, log):
        code, whole = served_eval(target, url, tmp_path / "whole")
    assert code == 0, whole
    requests = log.read_text().splitlines()
    assert len(requests) == 6
    log.unlink()
    with fake_vllm(port, log, die_at=5) as server:  # the first request of the last cell
        code, output = served_eval(target, url, out)
        assert server.poll() in (None, -signal.SIGKILL)  # dead, or not yet reaped
    assert code == 1 and "Traceback" not in output, output
    (line,) = [x for x in output.splitlines() if x.startswith("Error: ")]
    assert f"Error: the server at {url} stopped answering during chat[2:4]" in line
    assert "did not come back in 3 tries" in line and "restart the server" in line
    assert f"3 finished cell(s) of 4 are kept in {out / CELLS_FILE}" in line
    assert output.count("trying the cell again") == 2
    assert "Connection refused" in output  # the later tries found no server
    assert len((out / CELLS_FILE).read_text().splitlines()) == 3
    assert not (out / "record.json").exists()
    log.unlink()
    with fake_vllm(port, log):  # restarted: only the last cell is measured
        code, output = served_eval(target, url, out)
    assert code == 0, output
    # the last cell's two requests go out concurrently: in either order
    assert sorted(log.read_text().splitlines()) == sorted(requests[4:])
    assert json.loads((out / "record.json").read_text())["resumed_cells"] == 3
    assert eval_table(out) == eval_table(tmp_path / "whole")


# ------------------------------------------------------- disk faults: generate-data, eval
# As for train above: the writer of a chosen file puts part of its bytes down and raises
# ENOSPC; the same command on a disk with room again ends as the uninterrupted run.


@pytest.fixture
def one_thread():
    """torch on one thread while the test runs: on a busy 2-core machine two threads wait on
    each other and tiny models run 20 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli(args):
    from click.testing import CliRunner

    from speculators_peagle_plugin.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def half_json(path, obj, indent=None):
    """atomic_write_json whose temporary file gets half its text before the disk fills."""
    from speculators_peagle_plugin.common.files import atomic_write

    def write(tmp):
        tmp.write_text(json.dumps(obj)[:10])
        raise OSError(errno.ENOSPC, NO_SPACE)

    atomic_write(path, write)


def half_safetensors(tensors, path):
    Path(path).write_bytes(b"\0" * 100)


@pytest.mark.parametrize(("module", "name", "n", "part"), [
    ("turn_state", "atomic_write_json", 2, half_json),  # the second shard of replies
    ("capture", "save_safetensors", 3, half_safetensors),  # the third row's hidden states
])
@pytest.mark.usefixtures("one_thread")
def test_a_disk_that_fills_during_generate_data_keeps_the_finished_rows_and_resumes(
    target_dir, tmp_path, monkeypatch, module, name, n, part
):
    import importlib

    from helpers.chat_target import gen_args, write_prompt_rows

    from speculators_peagle_plugin.common.files import TMP_MARK

    prompts = write_prompt_rows(tmp_path / "prompts.jsonl")
    args_of = lambda out: gen_args(target_dir, prompts, out, "--batch-size", "2")  # noqa: E731
    code, out = cli(args_of(tmp_path / "whole"))
    assert code == 0, out
    mod = importlib.import_module(f"speculators_peagle_plugin.datagen.{module}")
    monkeypatch.setattr(mod, name, fill_on_call(n, part, OSError(errno.ENOSPC, NO_SPACE))(
        getattr(mod, name)))
    data = tmp_path / "data"
    line = refusal(*cli(args_of(data)))
    assert f"Writing {data} failed, no space left on the device" in line
    assert "for the generated data; free some space, then run the same command again" in line
    kept = [p for p in data.rglob("*") if p.parent.name in ("responses", "hidden_states")]
    assert kept and not [p for p in data.rglob("*") if TMP_MARK in p.name]
    for path in kept:  # each whole
        json.loads(path.read_text()) if path.suffix in (".json", ".turns") else load_safetensors(
            path)
    monkeypatch.undo()
    code, out = cli(args_of(data))
    assert code == 0, out
    assert data_rows(data) == data_rows(tmp_path / "whole")


class CutShortFile(CutShort):
    """:class:`CutShort` with the rest of a file's methods (flush, fileno)."""

    def __getattr__(self, name):
        return getattr(self.fh, name)


@pytest.mark.parametrize("where", ["a cell's line", "the record"])
@pytest.mark.usefixtures("one_thread")
def test_a_disk_that_fills_during_an_eval_keeps_the_finished_cells_and_resumes(
    target, draft_dir, tmp_path, monkeypatch, where
):
    from speculators_peagle_plugin.evaluation import cells, report

    args_of = lambda out: eval_args(target, draft_dir, out)  # noqa: E731
    code, out = cli(args_of(tmp_path / "whole"))
    assert code == 0, out
    opened = []

    def cut_on_second(path, mode="r", **kwargs):  # the second cell's line: half of it lands
        opened.append(mode)
        return CutShortFile(open(path, mode, **kwargs), lambda: opened.count("a") == 2)

    def no_room(path, text):
        raise OSError(errno.ENOSPC, NO_SPACE)

    if where == "the record":
        monkeypatch.setattr(report, "atomic_write_text", no_room)
        target_file, lines = "record.json", 4
    else:
        monkeypatch.setattr(cells, "open", cut_on_second, raising=False)
        target_file, lines = cells.CELLS_FILE, 1
    run = tmp_path / "run"
    line = refusal(*cli(args_of(run)))
    assert f"Writing {run / target_file} failed, no space left on the device" in line
    assert len((run / cells.CELLS_FILE).read_text().splitlines()) == lines + (lines == 1)
    assert not (run / "record.json").exists()
    monkeypatch.undo()
    code, out = cli(args_of(run))
    assert code == 0, out
    assert json.loads((run / "record.json").read_text())["resumed_cells"] == lines
    assert eval_table(run) == eval_table(tmp_path / "whole")
