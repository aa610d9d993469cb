"""The demo's prompt stages: validation prompts that are also training prompts (a chat set
repeats first turns) are left out, counted and said; the oracle is the sets themselves."""

import json
from pathlib import Path

import pytest

from speculators_peagle_plugin.data.prompts import load_prompt_set
from speculators_peagle_plugin.demo.artifacts import RunLayout
from speculators_peagle_plugin.demo.demo_config import DemoConfig
from speculators_peagle_plugin.demo.pipeline import _prompts_stage
from speculators_peagle_plugin.demo.stages import Stages

RECIPE = Path(__file__).parents[1] / "configs" / "recipes" / "long_smollm2.yaml"


def rows(path):
    return [json.loads(line)["messages"] for line in path.read_text().split("\n") if line]


def test_validation_prompts_that_are_training_prompts_are_left_out(tmp_path):
    config = DemoConfig.from_recipe(
        RECIPE, run_dir=str(tmp_path), train_prompts=("humaneval[0:3]+chat[0:3]",),
        validation_prompts=("chat[1:5]",), max_prompt_tokens=None,
    )
    layout, said = RunLayout(tmp_path), []
    stages = Stages(tmp_path, said.append)
    _prompts_stage(config, stages, layout.prompts, tmp_path)
    out = _prompts_stage(config, stages, layout.validation_prompts, tmp_path,
                         "validation prompts", config.validation_prompts, layout.prompts)
    chat = load_prompt_set("chat[0:5]").conversations
    assert rows(layout.validation_prompts) == chat[3:5]  # chat[1:3] are training prompts
    assert out["count"] == 2 and out["left_out"] == 2
    assert (f"[validation prompts] 2 conversations -> {layout.validation_prompts} (2 left out: "
            "training prompts too)") in said
    # a run directory whose validation prompts were written before they left training's out
    record = json.loads((tmp_path / "stages.json").read_text())
    del record["validation prompts"]["inputs"]["training_left_out"]
    (tmp_path / "stages.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="made with other settings \\(training_left_out\\)"):
        _prompts_stage(config, Stages(tmp_path, said.append), layout.validation_prompts,
                       tmp_path, "validation prompts", config.validation_prompts, layout.prompts)
