"""Bugs versus bad input (issue 59): our refusals, a full disk and an out-of-memory are one
sentence; anything else keeps its traceback and says what to report."""

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers.training import DRAFT_VOCAB, refusal, run_cli, train_args
from tiny import tiny_workdir

from speculators_peagle_plugin import cli
from speculators_peagle_plugin.common.errors import TRACEBACK_ENV, UserError, one_sentence
from speculators_peagle_plugin.common.reading import UnreadableFile, opening
from speculators_peagle_plugin.training import loop
from speculators_peagle_plugin.training.checkpoint import checkpoint_dirs


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tiny_workdir(tmp_path_factory.mktemp("errors"), DRAFT_VOCAB)


def planted(monkeypatch, error):
    """``train``'s first step raises ``error``."""

    def step(*args, **kwargs):
        raise error

    monkeypatch.setattr(loop, "train_step", step)


def test_an_internal_error_keeps_its_traceback_and_says_what_to_report(
    workdir, tmp_path, monkeypatch
):
    planted(monkeypatch, RuntimeError("an internal invariant broke"))
    code, out = run_cli(train_args(workdir, tmp_path / "save"))
    assert code == 1
    assert "Traceback (most recent call last)" in out
    assert "RuntimeError: an internal invariant broke" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("This is a bug in speculators-peagle") and "Error:" not in last
    assert "`speculators-peagle --version`" in last
    for package in ("torch", "speculators", "vllm", "transformers"):
        assert f"{package} " in last
    assert f"torch {torch.__version__}" in last


@pytest.mark.parametrize(
    ("error", "memory"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "GPU memory"),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
                      "allocate memory: you tried to allocate 8589934592 bytes."), "memory"),
        (MemoryError(), "memory"),
    ],
    ids=["cuda", "cpu-allocator", "python"],
)
def test_an_out_of_memory_is_one_sentence_naming_the_row_length_and_what_to_lower(
    workdir, tmp_path, monkeypatch, error, memory
):
    planted(monkeypatch, error)
    line = refusal(*run_cli(train_args(workdir, tmp_path / "save")))
    assert line.startswith(f"Error: Out of {memory} at rows of 96 tokens (")
    for flag in ("--total-seq-len", "--sequence-partitions", "--batch-size", "--kv-cache-gb"):
        assert flag in line
    assert not checkpoint_dirs(tmp_path / "save")


def test_the_environment_variable_shows_the_traceback_of_a_one_sentence_error(
    workdir, tmp_path, monkeypatch
):
    args = train_args(workdir, tmp_path / "save", "--lr", "fast")
    line = refusal(*run_cli(args))
    assert line == "Error: --lr 'fast' is not a number."
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    code, out = run_cli(args)
    assert code == 1 and "Traceback (most recent call last)" in out
    assert out.strip().splitlines()[-1] == line


def test_a_missing_user_file_is_bad_input_but_an_oserror_elsewhere_is_a_bug(
    workdir, tmp_path, monkeypatch
):
    line = refusal(*run_cli(["train", "--config", str(tmp_path / "missing.yaml")]))
    assert str(tmp_path / "missing.yaml") in line
    with pytest.raises(UnreadableFile, match="missing.jsonl cannot be read"):
        with opening(tmp_path / "missing.jsonl"):
            open(tmp_path / "missing.jsonl")
    monkeypatch.setattr(cli, "run_training", lambda config: open(tmp_path / "no" / "file"))
    result = CliRunner().invoke(cli.main, train_args(workdir, tmp_path / "save"))
    assert result.exit_code == 1 and "FileNotFoundError" in result.output
    assert result.output.strip().splitlines()[-1].startswith("This is a bug")


def test_which_errors_are_one_sentence():
    def raise_here(error):
        try:
            raise error
        except Exception as exc:  # noqa: BLE001
            return exc

    assert one_sentence(UserError("bad input.")) == "bad input."
    assert one_sentence(raise_here(OSError(28, "No space left on device"))).startswith(
        "No space left on the device"
    )
    assert one_sentence(raise_here(RuntimeError("CUDA error: an illegal memory access"))) is None
    # a ValueError that a library raised (numpy here) is a bug, not a refusal
    with pytest.raises(ValueError) as info:
        np.zeros(2).reshape(3)
    assert one_sentence(info.value) is None
    # so is a plain ValueError of our own code: its refusals are UserErrors
    from speculators_peagle_plugin.core.peagle_attention import document_ids_from_lengths

    with pytest.raises(ValueError, match="lengths must be >= 0") as info:
        document_ids_from_lengths(torch.tensor([-1]), 4)
    assert type(info.value) is ValueError and one_sentence(info.value) is None
