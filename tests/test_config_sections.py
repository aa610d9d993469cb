"""Config sections: each setting once, flat or section-grouped keys, ``--config`` on every
command, one sentence for bad input."""

import re

import pytest
from click.testing import CliRunner

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.settings import leaves
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.demo.demo_config import DemoConfig
from speculators_peagle_plugin.evaluation.eval_config import EvalConfig
from speculators_peagle_plugin.options import file_with, load_config
from speculators_peagle_plugin.training.train_config import TrainConfig

REQUIRED = "verifier_name_or_path: /m\ndata_path: /d\n"


@pytest.mark.parametrize("cls", [TrainConfig, DataGenConfig, EvalConfig, DemoConfig])
def test_every_key_names_one_setting(cls):
    keys = [leaf.key for leaf in leaves(cls)]
    assert len(keys) == len(set(keys))


def test_section_grouped_keys_mean_what_flat_keys_mean(tmp_path):
    nested, flat = tmp_path / "nested.yaml", tmp_path / "flat.yaml"
    nested.write_text(REQUIRED + "optimizer: {lr: 0.01}\npeagle:\n  num_depths: 5\n"
                      "online: {generation_backend: transformers}\n")
    flat.write_text(REQUIRED + "lr: 0.01\nnum_depths: 5\n")
    assert load_config(TrainConfig, nested, {}) == load_config(TrainConfig, flat, {})
    config = load_config(TrainConfig, nested, {"lr": "0.5"})  # a flag beats the file
    assert (config.optimizer.lr, config.peagle.cod.num_depths) == (0.5, 5)


def test_a_key_under_another_section_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(REQUIRED + "optimizer: {num_depths: 5}\n")
    with pytest.raises(ValueError, match=re.escape("Unknown key 'num_depths' under 'optimizer'")):
        load_config(TrainConfig, path, {})


def test_the_checkpoint_keeps_flat_settings_and_replace_changes_one_section(tmp_path):
    config = TrainConfig.from_sources(verifier_name_or_path="/m", data_path="/d", lr=0.01)
    flat = config.to_dict()
    assert flat["lr"] == 0.01 and flat["generation_backend"] == "transformers"
    assert "top_p" not in flat  # hidden in train: not a key there
    changed = config.replace(greedy_chains=True)
    assert changed.peagle.greedy_chains and changed.optimizer is config.optimizer
    with pytest.raises(ValueError, match="Unknown key"):
        config.replace(top_p=0.5)


def test_eval_reads_its_settings_from_a_file_and_flags_override_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "eval.yaml"
    path.write_text(f"target: {tmp_path}\nks: [4, 2]\nconcurrency: [1]\nprompt_sets: [chat]\n")
    config = load_config(EvalConfig, path, {"concurrency": "2,8"})
    assert (config.sweep.ks, config.sweep.concurrency) == ((2, 4), (2, 8))
    assert config.sweep.prompt_sets == ("chat",)


def test_a_demo_key_renames_its_sections_setting_in_errors():
    with pytest.raises(ValueError, match=re.escape("eval_max_new_tokens must be an integer >= 1")):
        DemoConfig.from_sources(eval_max_new_tokens=0)
    with pytest.raises(ValueError, match=re.escape("gen_batch_size must be an integer >= 1")):
        DemoConfig.from_sources(gen_batch_size=0)


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["generate-data", "--prompts", "chat", "--output", "o"], "target is required (--target)."),
        (["eval", "-k", "1,x"],
         "--num-speculative-tokens '1,x' is not a comma-separated list of integers."),
        (["check"], "checkpoint is required (CHECKPOINT)."),
        (["train", "--lr", "fast"], "--lr 'fast' is not a number."),
    ],
)
def test_bad_input_is_one_sentence_on_every_command(args, sentence):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == f"Error: {sentence}"


def test_every_command_reads_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("prompts: chat\noutput: o\n")
    result = CliRunner().invoke(main, ["generate-data", "--config", str(path)])
    assert result.output.strip().splitlines()[-1] == "Error: target is required (--target)."
    path.write_text("num_depth: 3\n")
    result = CliRunner().invoke(main, ["check", "--config", str(path), "ckpt"])
    assert result.exit_code == 1 and "Unknown key 'num_depth' in" in result.output


def test_a_tool_changes_a_file_in_its_own_shape():
    """file_with: each key set or dropped where the file writes it, flat or grouped; a key
    the file lacks goes under its section where the file has that section."""
    grouped = {"online": {"online": True}, "runtime": {"autocast": "bfloat16"},
               "trainer": {"early_stop_patience": 2}, "seed": 1}
    changed = file_with(TrainConfig, grouped, {"autocast": "none", "online": False, "lr": 0.5,
                                               "seed": 2}, drop=("early_stop_patience",))
    assert changed == {"online": {"online": False}, "runtime": {"autocast": "none"},
                       "seed": 2, "lr": 0.5}
    assert grouped["runtime"] == {"autocast": "bfloat16"}  # the file's mapping is untouched
    flat = {"online": True, "autocast": "bfloat16", "runtime": {"dtype": "float32"}}
    assert file_with(TrainConfig, flat, {"online": False, "autocast": "none", "device": "cpu"}) \
        == {"online": False, "autocast": "none", "runtime": {"dtype": "float32", "device": "cpu"}}
