"""The demo's settings: its config, its recipes and the one-sentence refusals of both
(demo/demo_config.py; the pipeline that runs them is test_demo.py's)."""

import json
import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.demo import pipeline as demo

RECIPE = Path(__file__).parents[1] / "configs" / "recipes" / "long_smollm2.yaml"


def test_demo_command_rejects_a_missing_config(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--config", str(tmp_path / "none.yaml")])
    assert result.exit_code != 0
    assert "training config" in result.output and "does not exist" in result.output


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        ({"gen_backend": "tgi"}, "gen_backend must be one of transformers, vllm, got 'tgi'."),
        ({"temperature": 0.0}, "num_samples 5 needs temperature > 0: greedy replies to the same"),
        ({"temperature": -1.0, "num_samples": 1}, "got -1.0."),
        ({"num_samples": 0}, "num_samples must be an integer >= 1, got 0."),
        (
            {"target_dtype": "fp8"},
            "target_dtype must be auto or one of float32, bfloat16, float16, got 'fp8'.",
        ),
    ],
)
def test_demo_config_rejects_bad_generation_settings(overrides, sentence):
    with pytest.raises(ValueError, match=re.escape(sentence)):
        demo.DemoConfig.from_sources(**overrides)


@pytest.mark.parametrize("recipe", sorted(RECIPE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_is_valid(recipe):
    config = demo.DemoConfig.from_recipe(recipe)
    assert Path(config.train_config).is_file()


def test_the_long_recipe_is_grouped_and_gives_what_its_flat_form_gave(tmp_path):
    """The replies' and the eval's keys under their sections; the same demo as the flat
    recipe (tests/golden/flat_configs.json) gave."""
    grouped = yaml.safe_load(RECIPE.read_text())
    assert set(grouped["replies"]) == {"num_samples", "temperature", "max_new_tokens"}
    assert all(key.startswith("eval_") for key in grouped["sweep"])
    flat = json.loads((Path(__file__).parent / "golden" / "flat_configs.json").read_text())[
        "recipes/long_smollm2.yaml"]
    flat["train_config"] = str(RECIPE.parent / flat["train_config"])
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump(flat))
    from_flat = demo.DemoConfig.from_recipe(tmp_path / "flat.yaml")
    assert from_flat == demo.DemoConfig.from_recipe(RECIPE)


def test_the_long_recipe_trains_on_ten_times_the_demos_prompts_none_held_out():
    from speculators_peagle_plugin.data.prompts import load_prompt_set

    config = demo.DemoConfig.from_recipe(RECIPE)
    assert config.replies.num_samples == 1 and config.max_prompt_tokens == 300
    (spec,) = config.train_prompts
    assert len(load_prompt_set(spec)) >= 10 * 220
    assert not set(config.sweep.prompt_sets) & set(config.validation_prompts)


def test_a_recipe_with_an_unknown_key_is_one_sentence(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run_dir: x\nepochs: 3\n")
    result = CliRunner().invoke(main, ["demo", "--recipe", str(recipe)])
    assert result.exit_code != 0
    assert "has unknown key(s) epochs; allowed: run_dir" in result.output
    result = CliRunner().invoke(main, ["demo", "--recipe", str(RECIPE), "--quick"])
    assert result.exit_code != 0 and "exclusive" in result.output
