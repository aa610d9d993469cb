"""eval/scaling.py's checkpoint plan: a checkpoint on every requested step of one run,
kept through train's rotation when the run is stopped and resumed."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.scaling import checkpoints_of_loop  # noqa: E402

from eval import scaling  # noqa: E402


@pytest.mark.parametrize("steps", [[500, 1000, 2000, 4000], [300, 1000], [7], [3, 5, 15], [1]])
def test_the_plan_puts_a_checkpoint_on_every_requested_step(steps):
    for per_epoch in [*range(1, 300), 997, 4000, 4001, 12345]:
        plan = scaling.checkpoint_plan(steps, per_epoch)
        total, kept = checkpoints_of_loop(plan)
        assert total == max(steps) and set(steps) <= set(kept)
        assert len(kept) == scaling.checkpoint_count(steps)


def test_the_checkpoint_count_is_capped():
    with pytest.raises(SystemExit, match="checkpoint every 1 steps .* 1000 in one run"):
        scaling.parse_args(["--steps", "333,1000"])
    assert scaling.parse_args(["--steps", "500,1000,2000,4000"]).steps == [500, 1000, 2000, 4000]


def test_a_stopped_and_resumed_run_keeps_every_requested_step(tmp_path):
    """A run stopped off the checkpoint grid (SIGTERM) saves where it stopped, and train's
    rotation counts that checkpoint: resumed twice, the run still holds every requested step."""
    steps = [2, 4, 8]
    plan = scaling.checkpoint_plan(steps, 100)
    stops = [5, 7]

    def runner(args):  # training/loop.py's saving and checkpoint.py's rotation, resumed
        save = Path(args[args.index("--save-path") + 1])
        keep = int(args[args.index("--keep-checkpoints") + 1])
        held = sorted(int(p.name.split("-")[1]) for p in save.glob("checkpoint-*"))
        end = stops.pop(0) if stops else plan["max_steps"]
        for step in range(held[-1] + 1 if held else 1, end + 1):
            if step % plan["every"] == 0 or step == end:
                (save / f"checkpoint-{step}").mkdir(parents=True)
                (save / f"checkpoint-{step}" / "training_state.pt").write_text(f"{step}")
                held.append(step)
                for old in held[:-keep]:
                    shutil.rmtree(save / f"checkpoint-{old}")
                held = held[-keep:]
        if end < plan["max_steps"]:
            raise SystemExit("train stopped by a signal")

    for _ in range(2):
        with pytest.raises(SystemExit, match="signal"):
            scaling.train_cell(tmp_path / "cell", plan, [], steps, runner)
    save = scaling.train_cell(tmp_path / "cell", plan, [], steps, runner)
    assert sorted(int(p.name.split("-")[1]) for p in save.glob("checkpoint-*")) == steps
