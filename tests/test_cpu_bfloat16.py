"""The rule for CPUs without native bfloat16 (``common.devices``): train with float32
matmuls (``autocast none``) and run the target in float32, where ``auto`` leaves it to us."""

from pathlib import Path

import pytest
import torch
import yaml

from speculators_peagle_plugin.common.devices import (
    cpu_has_bfloat16,
    cpu_target_dtype,
    cpu_train_settings,
)
from speculators_peagle_plugin.common.dtypes import DTYPE_NAMES
from speculators_peagle_plugin.demo.demo_config import DemoConfig
from speculators_peagle_plugin.options import config_argv
from speculators_peagle_plugin.training.train_config import TrainConfig


def test_the_check_is_onednns():
    assert cpu_has_bfloat16() is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_without_native_bfloat16_training_autocasts_nothing_and_the_target_is_float32():
    assert cpu_train_settings(False) == {"autocast": "none"}
    assert config_argv(TrainConfig, cpu_train_settings(False)) == ["--autocast", "none"]
    assert cpu_target_dtype(False) == "float32"


def test_with_native_bfloat16_the_recipe_and_bfloat16_stand():
    assert cpu_train_settings(True) == {}
    assert cpu_target_dtype(True) == "bfloat16"
    assert {cpu_target_dtype(n) for n in (True, False)} <= set(DTYPE_NAMES)


@pytest.mark.parametrize("native", [True, False])
def test_the_scaling_grids_yaml_follows_the_rule(native, tmp_path):
    from eval.scaling_cells import train_yaml

    recipe = Path(DemoConfig.train_config)
    runtime = yaml.safe_load(recipe.read_text())["runtime"]  # the recipe's section
    assert runtime["autocast"] == "bfloat16"  # the recipe asks for it
    written = yaml.safe_load(train_yaml(recipe, tmp_path / "t.yaml", native).read_text())
    assert written["runtime"] == {**runtime, "autocast": "bfloat16" if native else "none"}
