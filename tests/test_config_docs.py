"""docs/config.md is generated from the settings (speculators_peagle_plugin/config_docs.py):
every key of every command's config under its section, and where speculators groups a
train key elsewhere."""

from pathlib import Path

import pytest
import yaml

from speculators_peagle_plugin import config_docs
from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.settings import leaves
from speculators_peagle_plugin.options import load_config, section_of
from speculators_peagle_plugin.training.train_config import TrainConfig

PAGE = Path(__file__).parents[1] / "docs" / "config.md"
REQUIRED = {"verifier_name_or_path": "/m", "data_path": "/d"}


def test_the_page_is_generated_from_the_settings():
    assert PAGE.read_text() == config_docs.render(), (
        f"docs/config.md is stale: regenerate it with `{config_docs.REGENERATE}`"
    )


def test_every_key_of_every_command_is_under_its_section():
    text = config_docs.render()
    configs = {name: cmd.callback.config_class for name, cmd in main.commands.items()
               if hasattr(cmd.callback, "config_class")}
    assert {"train", "generate-data", "eval", "demo"} <= set(configs)
    for name, cls in configs.items():
        page = text.split(f"\n## `{name}`\n", 1)[1].split("\n## ", 1)[0]
        for leaf in leaves(cls):
            section = section_of(leaf)
            title = "no section (root keys)" if section is None else f"`{section}`"
            rows = page.split(f"\n### {title}\n", 1)[1].split("\n### ", 1)[0]
            assert f"\n| `{leaf.key}` | " in rows, (name, leaf.key)


def test_the_keys_speculators_groups_elsewhere_are_named():
    train = config_docs.render().split("\n## `train`\n", 1)[1]
    for ours, theirs in [
        ("logging.log_freq", "trainer.log_freq"),
        ("runtime.gradient_checkpointing", "trainer.gradient_checkpointing"),
        ("runtime.fsdp", "trainer.fsdp_shard"),
        ("peagle.max_anchors", "data.max_anchors"),
        ("runtime.autocast", "data.hidden_states_dtype"),
    ]:
        assert f"`{ours}` (theirs: `{theirs}`)" in train
    assert "| `lr` | `--lr` | `0.001` | " in train and "| same |" in train


@pytest.mark.parametrize(("ours", "theirs", "value"), [
    ("logging.log_freq", "trainer.log_freq", 5),
    ("peagle.max_anchors", "data.max_anchors", 3),
    ("runtime.gradient_checkpointing", "trainer.gradient_checkpointing", True),
    ("runtime.fsdp", "trainer.fsdp_shard", True),
    ("runtime.autocast", "data.hidden_states_dtype", "bfloat16"),
])
def test_a_key_speculators_groups_elsewhere_is_read_in_either_place(ours, theirs, value,
                                                                    tmp_path):
    configs = []
    for name in (ours, theirs):
        group, key = name.split(".")
        path = tmp_path / f"{group}.yaml"
        path.write_text(yaml.safe_dump({**REQUIRED, group: {key: value}}))
        configs.append(load_config(TrainConfig, path, {}))
    assert configs[0] == configs[1] != load_config(TrainConfig, None, REQUIRED)
