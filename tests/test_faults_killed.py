"""Commands killed with SIGKILL at random points (issue 59): the same command afterwards
finishes with the result of an uninterrupted run. ``docs/bad_input.md`` lists each fault and
its test; the other faults are in ``test_faults.py``."""

import json
import shutil

import pytest
from helpers.kills import Forker, kill_times
from helpers.results import checkpoint_bytes, data_rows, eval_args, eval_table, save_tiny_draft
from helpers.training import train_args


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("killed") / "workdir")


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    return save_tiny_draft(target, tmp_path_factory.mktemp("draft") / "draft")


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
    # the shorter of two whole runs: a first run on a loaded machine can take many times longer
    again = forker.run(args_of(tmp_path / "again"), log, **run)
    assert again["rc"] == 0 and result_of(tmp_path / "again") == expected
    seconds = min(whole["seconds"], again["seconds"])
    caught = 0
    for i, at in enumerate(kill_times(seed, KILLS, seconds)):
        out = tmp_path / f"killed-{i}"
        caught += forker.run(args_of(out), log, kill_after=at, **run)["killed"]
        rerun = forker.run(args_of(out), log, **run)
        assert rerun["rc"] == 0, f"rerun after a kill at {at:.2f} s:\n" + log.read_text()[-3000:]
        assert result_of(out) == expected, f"killed at {at:.2f} s of {seconds:.2f} s"
    print(f"{caught} of {KILLS} runs killed before their end ({seconds:.2f} s)")
    assert caught >= KILLS // 2, f"only {caught} of {KILLS} kills came before the end"
    return caught


@pytest.mark.slow
def test_train_killed_at_random_points_resumes_to_the_same_checkpoint_bytes(
    workdir, forker, tmp_path
):
    steps = ("--max-steps", "6", "--checkpoint-freq", "0.01")  # a checkpoint every step
    killed_and_rerun(forker, tmp_path, 59, lambda save: train_args(workdir, save, *steps),
                     checkpoint_bytes)


@pytest.mark.slow
def test_generate_data_killed_at_random_points_resumes_to_the_same_rows(
    target_dir, forker, tmp_path
):
    from helpers.chat_target import gen_args, write_prompt_rows

    prompts = write_prompt_rows(tmp_path / "prompts.jsonl")
    sampled = ("--temperature", "1.0", "--batch-size", "2")  # several batches, sampled replies
    killed_and_rerun(forker, tmp_path, 60, lambda out: gen_args(target_dir, prompts, out, *sampled),
                     data_rows)


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
