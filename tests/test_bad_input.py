"""Bad input as a new user meets it (issue 22): one sentence, a non-zero exit, nothing
half-written, no code run. ``docs/bad_input.md`` lists each case and its test."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.training import DRAFT_VOCAB, refusal, run_cli, train_args, train_ok
from tiny import tiny_workdir

from speculators_peagle_plugin.common.lock import LOCK_FILE, DirectoryLocked, exclusive_directory
from speculators_peagle_plugin.data.dataset import TrainingData
from speculators_peagle_plugin.data.layout import SETTINGS_FILE
from speculators_peagle_plugin.training.checkpoint import STATE_FILE, checkpoint_dirs

REPO = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tiny_workdir(tmp_path_factory.mktemp("bad"), DRAFT_VOCAB)


@pytest.fixture(scope="module")
def trained(workdir, tmp_path_factory):
    """A save path with checkpoint-1 and checkpoint-2 (one per step)."""
    save = train_ok(workdir, tmp_path_factory.mktemp("trained") / "save", "--max-steps", "2",
                    "--checkpoint-freq", "0.01")
    assert [p.name for p in checkpoint_dirs(save)] == ["checkpoint-1", "checkpoint-2"]
    return save


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ------------------------------------------------------------------ one writer per directory

HOLD_LOCK = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, (sys.argv[2] if len(sys.argv) > 2 else str(os.getpid())).encode())
    print("locked", flush=True)
    time.sleep(120)
    """
)


def test_a_live_holder_is_named_and_a_killed_ones_lock_is_taken_over(tmp_path, caplog):
    directory = tmp_path / "save"
    directory.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(directory / LOCK_FILE)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        held = f"in use by another training run \\(PID {holder.pid}\\)"
        with pytest.raises(DirectoryLocked, match=held):
            with exclusive_directory(directory, "training run"):
                pass
    finally:
        holder.kill()
        holder.wait()
    caplog.set_level(logging.INFO)
    with exclusive_directory(directory, "training run"):
        assert (directory / LOCK_FILE).read_text().strip() == str(os.getpid())
    assert f"took over the lock of PID {holder.pid}" in caplog.text
    assert not (directory / LOCK_FILE).exists()


def test_a_lock_kept_past_its_writers_exit_says_the_writer_has_exited(tmp_path):
    """What another program's child holding the lock looks like: the writer the file names
    has exited, the lock is still held."""
    directory = tmp_path / "data"
    directory.mkdir()
    writer = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)
    dead = writer.stdout.strip()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(directory / LOCK_FILE), dead],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirectoryLocked) as refused:
            with exclusive_directory(directory, "generate-data"):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert str(refused.value) == (
        f"{directory} is locked by a process that outlived the generate-data that took it "
        f"(PID {dead}, exited): stop what that run started, or use another directory."
    )


# a writer that forks a worker pool under its lock, as a ``datasets`` map does
LOCK_THEN_FORK = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from speculators_peagle_plugin.common.lock import exclusive_directory
    with exclusive_directory(sys.argv[1], "generate-data"):
        pool = multiprocessing.get_context("fork").Pool(1)
        print(pool.apply(os.getpid), flush=True)
        time.sleep(120)
    """
)


def test_a_killed_writers_forked_workers_do_not_keep_its_lock(tmp_path):
    directory = tmp_path / "data"
    writer = subprocess.Popen([sys.executable, "-c", LOCK_THEN_FORK, str(directory)],
                              stdout=subprocess.PIPE, text=True)
    worker = int(writer.stdout.readline())
    try:
        writer.kill()  # SIGKILL to the writer alone: its worker lives on
        writer.wait()
        os.kill(worker, 0)
        with exclusive_directory(directory, "generate-data"):
            assert (directory / LOCK_FILE).read_text().strip() == str(os.getpid())
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_second_training_on_a_save_path_in_use_is_refused_at_once(workdir, tmp_path):
    save = tmp_path / "save"
    with exclusive_directory(save, "training run"):
        line = refusal(*run_cli(train_args(workdir, save, "--max-steps", "1")))
        assert f"{save} is in use by another training run (PID {os.getpid()})" in line
        assert [p.name for p in save.iterdir()] == [LOCK_FILE]  # nothing of the second run's


def test_generate_data_into_a_directory_in_use_is_refused(workdir, tmp_path):
    out = tmp_path / "data"
    args = ["generate-data", "--target", str(workdir / "target"),
            "--prompts", str(workdir / "prompts.jsonl"), "--output", str(out),
            "--target-layer-ids", "1,2,3", "--draft-vocab-size", str(DRAFT_VOCAB)]
    with exclusive_directory(out, "generate-data"):
        line = refusal(*run_cli(args))
        assert f"in use by another generate-data (PID {os.getpid()})" in line


# ------------------------------------------------------------------ divergence


def test_a_diverging_run_stops_before_saving_the_non_finite_state(workdir, tmp_path):
    save = tmp_path / "save"
    args = train_args(workdir, save, "--max-steps", "6", "--checkpoint-freq", "0.01")
    args[args.index("--lr") + 1] = "1e9"
    line = refusal(*run_cli(args))
    assert "Training diverged at step" in line and "newest checkpoint is still" in line
    newest = checkpoint_dirs(save)[-1]
    assert str(newest) in line
    from safetensors.torch import load_file

    weights = load_file(newest / "model.safetensors")
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())


# ------------------------------------------------------------------ layer ids


def test_layer_ids_other_than_the_datas_are_refused(workdir, tmp_path):
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, "--target-layer-ids", "0,1,2")))
    assert "Aux layer ids [0, 1, 2] name layer(s) [0] whose states the data" in line
    assert "it holds those of layers [1, 2, 3] and of layer 4 (after the last layer)" in line
    assert not save.exists()


def test_data_without_a_layer_record_still_trains_and_says_so(workdir, tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(workdir / "data", data)
    (data / SETTINGS_FILE).unlink()
    args = train_args(workdir, tmp_path / "save", "--max-steps", "1", "--target-layer-ids", "1,2,3")
    args[args.index("--data-path") + 1] = str(data)
    caplog.set_level(logging.INFO)
    code, out = run_cli(args)
    assert code == 0, out
    assert "does not record which target layers" in caplog.text


# ------------------------------------------------------------------ corrupt checkpoints


@pytest.mark.parametrize("damaged", [STATE_FILE, "model.safetensors"])
def test_auto_resume_skips_a_damaged_checkpoint_for_the_newest_intact_one(
    workdir, trained, tmp_path, caplog, damaged
):
    save = tmp_path / "save"
    shutil.copytree(trained, save)
    truncate(save / "checkpoint-2" / damaged)
    caplog.set_level(logging.INFO)
    train_ok(workdir, save, "--max-steps", "3")
    assert f"not resuming from checkpoint-2: {save / 'checkpoint-2' / damaged}" in caplog.text
    assert f"resumed from {save / 'checkpoint-1'} at step 1" in caplog.text
    # --resume names one checkpoint: a damaged one is an error, not skipped
    resume = ["--resume", str(save / "checkpoint-2"), "--max-steps", "4"]
    truncate(save / "checkpoint-2" / damaged)
    line = refusal(*run_cli(train_args(workdir, save, *resume)))
    assert str(save / "checkpoint-2" / damaged) in line


def test_a_full_disk_leaves_no_temporary_checkpoint_and_says_what_it_needed(
    workdir, tmp_path, monkeypatch
):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, "--max-steps", "1")))
    assert "no space left on the device: a checkpoint needs about" in line
    assert sorted(p.name for p in save.iterdir()) == ["metrics.jsonl"]  # no .tmp- directory


def test_a_corrupt_dataset_file_is_named(workdir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(workdir / "data", data)
    (arrow,) = data.glob("data-*.arrow")
    truncate(arrow, 50)
    args = train_args(workdir, tmp_path / "save", "--max-steps", "1")
    args[args.index("--data-path") + 1] = str(data)
    line = refusal(*run_cli(args))
    assert str(data) in line
    assert not (tmp_path / "save").exists()


def test_device_cuda_without_cuda_is_one_sentence(workdir, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = refusal(*run_cli(train_args(workdir, tmp_path / "save", "--device", "cuda")))
    assert "--device cuda: this machine has no CUDA device; use --device cpu." in line
    assert not (tmp_path / "save").exists()
    args = ["generate-data", "--target", str(workdir / "target"), "--device", "cuda",
            "--prompts", str(workdir / "prompts.jsonl"), "--output", str(tmp_path / "data")]
    line = refusal(*run_cli(args))
    assert "--device cuda: this machine has no CUDA device" in line
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------ paths and order of checks


def test_the_same_save_path_spelled_differently_resumes(
    workdir, trained, tmp_path, monkeypatch, caplog
):
    shutil.copytree(trained, tmp_path / "save")
    monkeypatch.chdir(tmp_path)
    args = train_args(workdir, "save/", "--max-steps", "3")
    # relative now, absolute when trained
    args[args.index("--data-path") + 1] = os.path.relpath(workdir / "data") + "/"
    caplog.set_level(logging.INFO)
    code, out = run_cli(args)
    assert code == 0, out
    assert "resumed from save/checkpoint-2 at step 2" in caplog.text
    assert f"final checkpoint: {Path('save') / 'checkpoint-3'}" in out


def test_a_save_path_that_is_a_file_is_one_sentence(tmp_path):
    save = tmp_path / "save"
    save.write_text("mine")
    argv = ["train", "--verifier-name-or-path", str(tmp_path / "target"),
            "--data-path", str(tmp_path / "data"), "--save-path", str(save)]
    assert refusal(*run_cli(argv)) == (
        f"Error: --save-path {save} is a file, not a directory; choose a new or empty "
        "directory, or the save path of the run to resume."
    )
    assert save.read_text() == "mine"


def test_resume_into_a_new_save_path_continues_there(workdir, trained, tmp_path, caplog):
    new = tmp_path / "new"
    resume = ["--resume", str(trained / "checkpoint-1"), "--max-steps", "2"]
    caplog.set_level(logging.INFO)
    train_ok(workdir, new, *resume)
    assert f"resumed from {trained / 'checkpoint-1'} at step 1" in caplog.text
    assert [p.name for p in checkpoint_dirs(new)] == ["checkpoint-2"]


@pytest.mark.parametrize(
    ("extra", "sentence"),
    [
        (["--mask-token-id", "5"], "mask_token_id 5"),
        (["--resume", "/nonexistent/ckpt"], "--resume /nonexistent/ckpt is not a checkpoint"),
    ],
)
def test_cheap_checks_run_before_the_data_scan(workdir, tmp_path, monkeypatch, extra, sentence):
    def scanned(self, progress=True):
        raise AssertionError("the data was scanned before the cheap checks")

    monkeypatch.setattr(TrainingData, "validate", scanned)
    save = tmp_path / "save"
    line = refusal(*run_cli(train_args(workdir, save, "--max-steps", "1", *extra)))
    assert sentence in line
    assert not save.exists(), "a failed run left an empty save directory"


def test_an_output_path_that_cannot_be_made_is_refused_before_any_work_naming_its_flag(
    workdir, tmp_path, monkeypatch
):
    def scanned(self, progress=True):
        raise AssertionError("the data was scanned before the output paths were checked")

    monkeypatch.setattr(TrainingData, "validate", scanned)
    save = tmp_path / "save"
    args = train_args(workdir, save, "--logger", "tensorboard", "--log-dir", "/proc/nope/tb")
    assert refusal(*run_cli(args)) == (
        "Error: --log-dir /proc/nope/tb cannot be created: making a directory in /proc fails "
        "(No such file or directory); choose a writable path."
    )
    assert not save.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    under = str(blocker / "sub")
    target = str(workdir / "target")
    for flag, args in (
        ("--save-path", train_args(workdir, under)),
        ("--log-dir", train_args(workdir, save, "--logger", "tensorboard", "--log-dir", under)),
        ("--output", ["generate-data", "--target", target, "--prompts",
                      str(workdir / "prompts.jsonl"), "--output", under]),
        ("--out", ["eval", "--target", target, "--prompts", "chat[:1]", "--out", under]),
        ("OUTPUT", ["export", str(tmp_path / "draft"), under, "--target", target]),
    ):
        assert refusal(*run_cli(args)) == (
            f"Error: {flag} {under} cannot be a directory: {blocker} is a file; choose another "
            "path."
        ), flag
    assert blocker.read_text() == "mine" and not save.exists()


# ------------------------------------------------------------------ check / export / eval


def draft_checkpoint(trained, tmp_path):
    ckpt = tmp_path / "draft"
    shutil.copytree(trained / "checkpoint-2", ckpt)
    return ckpt


def test_a_truncated_draft_is_one_sentence_in_check_export_and_eval(workdir, trained, tmp_path):
    ckpt = draft_checkpoint(trained, tmp_path)
    truncate(ckpt / "model.safetensors")
    target = str(workdir / "target")
    for args in (
        ["check", str(ckpt), "--target", target],
        ["export", str(ckpt), str(tmp_path / "out"), "--target", target],
        ["eval", "--target", target, "--draft", str(ckpt), "--prompts", "chat[:1]",
         "--out", str(tmp_path / "eval")],
    ):
        line = refusal(*run_cli(args))
        assert f"{ckpt / 'model.safetensors'} is corrupt or truncated" in line, args
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "sentence"),
    [("[1, 2]", "holds a JSON list, but an object is expected."), ("{", "is not readable JSON")],
)
def test_a_config_json_that_is_not_an_object_is_one_sentence(
    workdir, trained, tmp_path, text, sentence
):
    ckpt = draft_checkpoint(trained, tmp_path)
    (ckpt / "config.json").write_text(text)
    for command in ("check", "export"):
        args = [command, str(ckpt), *([str(tmp_path / "out")] if command == "export" else [])]
        line = refusal(*run_cli(args))
        assert f"{ckpt / 'config.json'} {sentence}" in line


def test_export_fills_a_null_speculators_config(workdir, trained, tmp_path):
    ckpt = draft_checkpoint(trained, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["speculators_config"] = None
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    target = workdir / "target"
    args = ["export", str(ckpt), str(out), "--target", str(target), "-k", "3", "--device", "any"]
    code, text = run_cli(args)
    assert code == 0, text
    assert "fixed [speculative-tokens]" in text and "fixed [verifier]" in text
    fixed = json.loads((out / "config.json").read_text())["speculators_config"]
    assert fixed["algorithm"] == "peagle"
    assert fixed["proposal_methods"][0]["speculative_tokens"] == 3
    assert fixed["verifier"] == {"name_or_path": str(target), "architectures": ["LlamaForCausalLM"]}


# ------------------------------------------------------------------ setup


@pytest.mark.parametrize(("gpu", "extra"), [(False, "cpu"), (True, "cuda")])
def test_setup_installs_the_stack_of_the_machine(tmp_path, gpu, extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    plan = subprocess.run(
        ["make", "-n", "-B", "setup"], cwd=REPO, env={"PATH": path}, capture_output=True,
        text=True, check=True,
    ).stdout
    assert f"-e '.[{extra},dev]'" in plan
    other = "cuda" if extra == "cpu" else "cpu"
    assert f".[{other}," not in plan


def test_a_metrics_line_cut_by_a_kill_is_dropped_on_resume(workdir, trained, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(trained, save)
    with open(save / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "lo')
    train_ok(workdir, save, "--max-steps", "3")
    steps = [json.loads(x)["step"] for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_what_a_killed_run_left_is_cleared_and_the_rerun_resumes(
    workdir, trained, tmp_path, caplog
):
    save = tmp_path / "save"
    shutil.copytree(trained, save)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (save / LOCK_FILE).write_text(dead)  # its flock died with it
    (save / f".checkpoint-3.tmp-{dead}").mkdir()  # a checkpoint it was writing
    caplog.set_level(logging.INFO)
    train_ok(workdir, save, "--max-steps", "3")
    assert f"took over the lock of PID {dead}" in caplog.text
    assert "resumed from" in caplog.text and "at step 2" in caplog.text
    assert sorted(p.name for p in save.iterdir() if p.name.startswith(".")) == []
