"""Faults a run survives (issue 59): each ends in one sentence, loses nothing, and the same
command afterwards finishes with the result of an uninterrupted run.
``docs/bad_input.md`` lists each fault and its test."""

import errno
import json
import logging
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.kills import Forker, kill_times
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


# ------------------------------------------------------------------ killed at random points
# SIGKILL at KILLS points of a command's run, drawn by a seeded generator over the duration
# of an uninterrupted run (helpers.kills: each run forked from one process that imported
# the package). After each kill the same command runs to its end, and its result equals
# the uninterrupted run's.

KILLS = 10


@pytest.fixture(scope="module")
def forker():
    with Forker() as f:
        yield f


def killed_and_rerun(forker, tmp_path, seed, args_of, result_of, **run):
    """Kill ``args_of(out)`` at KILLS seeded points, rerun it each time: every rerun ends as
    the uninterrupted run does. Returns how many of the runs the kill caught before their end."""
    log = tmp_path / "log.txt"
    whole = forker.run(args_of(tmp_path / "whole"), log, **run)
    assert whole["rc"] == 0, log.read_text()[-3000:]
    expected = result_of(tmp_path / "whole")
    caught = 0
    for i, at in enumerate(kill_times(seed, KILLS, whole["seconds"])):
        out = tmp_path / f"killed-{i}"
        caught += forker.run(args_of(out), log, kill_after=at, **run)["killed"]
        rerun = forker.run(args_of(out), log, **run)
        assert rerun["rc"] == 0, f"rerun after a kill at {at:.2f} s:\n" + log.read_text()[-3000:]
        assert result_of(out) == expected, f"killed at {at:.2f} s of {whole['seconds']:.2f} s"
    print(f"{caught} of {KILLS} runs killed before their end ({whole['seconds']:.2f} s)")
    assert caught >= KILLS // 2, f"only {caught} of {KILLS} kills came before the end"
    return caught


def checkpoint_bytes(save):
    """Every kept checkpoint's weights and config (bytes), and the steps the log records."""
    files = ("model.safetensors", "config.json")
    kept = {c.name: [(c / f).read_bytes() for f in files] for c in checkpoint_dirs(save)}
    lines = (save / progress.METRICS_FILE).read_text().splitlines()
    return kept, [json.loads(line)["step"] for line in lines]


@pytest.mark.slow
def test_train_killed_at_random_points_resumes_to_the_same_checkpoint_bytes(
    workdir, forker, tmp_path
):
    steps = ("--max-steps", "6", "--checkpoint-freq", "0.01")  # a checkpoint every step
    killed_and_rerun(forker, tmp_path, 59, lambda save: train_args(workdir, save, *steps),
                     checkpoint_bytes)


def data_rows(output):
    """The dataset's rows and the bytes of every other file generate-data writes, by name."""
    from datasets import load_from_disk

    rows = load_from_disk(str(output)).to_dict()
    files = {p.relative_to(output).as_posix(): p.read_bytes() for p in sorted(output.rglob("*"))
             if p.is_file() and p.suffix in (".safetensors", ".npy", ".pt")}
    return rows, files


@pytest.mark.slow
def test_generate_data_killed_at_random_points_resumes_to_the_same_rows(
    target_dir, forker, tmp_path
):
    from helpers.chat_target import gen_args, write_prompt_rows

    prompts = write_prompt_rows(tmp_path / "prompts.jsonl")
    sampled = ("--temperature", "1.0", "--batch-size", "2")  # several batches, sampled replies
    killed_and_rerun(forker, tmp_path, 60, lambda out: gen_args(target_dir, prompts, out, *sampled),
                     data_rows)


# what differs between two runs of the same eval: the clock, the machine, where it ran
TIMING = ("wall_s", "tokens_per_s", "tpot_s", "speedup", "resumed")


def eval_table(out):
    """record.json less its timing (and what follows from it: the recommendation), its
    provenance and its output directory."""
    record = json.loads((out / "record.json").read_text())
    for name in ("provenance", "resumed_cells", "recommendation"):
        record.pop(name)
    record["config"].pop("output_dir")
    for run in record["runs"]:
        for name in TIMING:
            run.pop(name)
    return record


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """A random tiny draft of ``target`` (K up to 3), saved."""
    from tiny_vllm import tiny_vllm_draft

    path = tmp_path_factory.mktemp("draft") / "draft"
    tiny_vllm_draft(target).save_pretrained(path)
    return path


def eval_args(target, draft, out):
    return ["eval", "--target", target, "--draft", draft, "-k", "2", "--prompts", "chat[:2]",
            "--concurrency", "1,2", "--max-new-tokens", "8", "--backend", "reference",
            "--out", out]


@pytest.mark.slow
def test_eval_killed_at_random_points_resumes_to_the_same_record(
    target, draft_dir, forker, tmp_path
):
    killed_and_rerun(forker, tmp_path, 61, lambda out: eval_args(target, draft_dir, out),
                     eval_table)


def demo_result(run_dir):
    """What the demo made: its stages' outputs (paths under RUN), the served draft's weights,
    the eval's table."""
    stages = json.loads((run_dir / "stages.json").read_text().replace(str(run_dir), "RUN"))
    outputs = {name: stage["outputs"] for name, stage in stages.items()}
    weights = (run_dir / "trained-draft" / "model.safetensors").read_bytes()
    table = json.loads(json.dumps(eval_table(run_dir / "eval")).replace(str(run_dir), "RUN"))
    return outputs, weights, table


@pytest.mark.slow
def test_the_demo_killed_at_random_points_resumes_to_the_same_result(target, forker, tmp_path):
    from helpers.tiny_demo import recipe

    path = recipe(tmp_path)
    killed_and_rerun(forker, tmp_path, 62, lambda run: ["demo", "--recipe", path, "--run-dir", run],
                     demo_result, setup=("helpers.tiny_demo:install", target))


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
        assert server.wait(10) == -signal.SIGKILL
    assert code == 1 and "Traceback" not in output, output
    (line,) = [x for x in output.splitlines() if x.startswith("Error: ")]
    assert f"Error: the server at {url} stopped answering during chat[2:4]" in line
    assert "did not come back in 3 tries" in line and "restart the server" in line
    assert f"3 finished cell(s) of 4 are kept in {out / CELLS_FILE}" in line
    assert output.count("trying the cell again") == 2
    assert len((out / CELLS_FILE).read_text().splitlines()) == 3
    assert not (out / "record.json").exists()
    log.unlink()
    with fake_vllm(port, log):  # restarted: only the last cell is measured
        code, output = served_eval(target, url, out)
    assert code == 0, output
    assert log.read_text().splitlines() == requests[4:]
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
    ("generation", "atomic_write_json", 2, half_json),  # the second shard of replies
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
        json.loads(path.read_text()) if path.suffix == ".json" else load_safetensors(path)
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
