"""TrainConfig: one default per field, YAML < flags, one-sentence errors."""

import json
import re
from pathlib import Path

import pytest
import yaml

from speculators_peagle_plugin.common.settings import leaves
from speculators_peagle_plugin.core.peagle_config import CODConfig
from speculators_peagle_plugin.options import load_config, section_of
from speculators_peagle_plugin.training.train_config import TrainConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
REQUIRED = {"verifier_name_or_path": "/m", "data_path": "/d"}


def build_train_config(config_file, flags):
    """``train``'s config from a YAML file and flags as click passes them (text)."""
    return load_config(TrainConfig, config_file, flags)


def no_flags(**given):
    return dict(given)  # a flag not given is absent


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    config = build_train_config(str(path), no_flags(**REQUIRED))
    assert config.algorithm == "peagle"
    assert isinstance(config.peagle.cod, CODConfig)


def test_shipped_configs_cover_the_demo_llama_qwen_and_long_context():
    names = {p.stem for p in CONFIGS}
    assert {"demo_smollm2", "llama3_1_8b", "qwen3_8b", "long_context"} <= names
    shipped = {p.stem: build_train_config(str(p), no_flags(**REQUIRED)) for p in CONFIGS}
    for name in ("llama3_1_8b", "qwen3_8b"):
        assert shipped[name].draft.num_layers == 4 and shipped[name].peagle.cod.num_depths == 8
    assert shipped["long_context"].peagle.sequence_partitions > 1


# The shipped configs as they were written flat, before they were grouped in sections (a
# config changed on purpose changes here too).
FLAT = json.loads((Path(__file__).parent / "golden" / "flat_configs.json").read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_grouped_and_gives_what_its_flat_form_gave(path, tmp_path):
    """Each key sits under the section that owns it (the root's own at the root), and the
    file loads to exactly the config its flat form loaded to: the same training."""
    by_key = {leaf.key: leaf for leaf in leaves(TrainConfig)}
    placed = {}
    for key, value in yaml.safe_load(path.read_text()).items():
        if isinstance(value, dict):
            placed.update({sub: key for sub in value})
        else:
            placed[key] = None
    assert placed == {key: section_of(by_key[key]) for key in placed}
    assert any(placed.values())
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump(FLAT[path.name]))
    assert sorted(placed) == sorted(FLAT[path.name])
    given = no_flags(**REQUIRED)
    assert build_train_config(str(path), given) == build_train_config(str(flat), given)


def test_precedence_defaults_then_file_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_depths: 5\nlr: 0.01\ntarget_layer_ids: [1, 2, 3]\n")
    config = build_train_config(str(path), no_flags(**REQUIRED, lr="0.5"))
    flat = config.to_dict()
    assert (flat["num_depths"], flat["lr"], flat["target_layer_ids"]) == (5, 0.5, (1, 2, 3))
    assert config.peagle.cod.down_sample_ratio == CODConfig.down_sample_ratio  # untouched default
    flags = no_flags(**REQUIRED, target_layer_ids="4,5 6", sliding_window="none")
    config = build_train_config(str(path), flags)
    assert config.draft.target_layer_ids == (4, 5, 6) and config.draft.sliding_window is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_depht: 5\n", "Unknown key 'num_depht' in"),
        ("lr: fast\n", "lr must be of type float, got 'fast'."),
        ("num_depths: 0\n", "num_depths must be an integer >= 1, got 0."),
        ("sequence_partitions: 0\n", "sequence_partitions must be an integer >= 1"),
        ("draft_arch: gpt2\n", "draft_arch must be one of llama, qwen3, got 'gpt2'."),
        ("- a\n- b\n", "must hold a mapping"),
        ("num_depths: 3\nnum_speculative_tokens: 4\n",
         "num_speculative_tokens must be an integer in [1, num_depths=3], got 4."),
        ("hard_label_weight: 1.5\n", "hard_label_weight must be a number in [0, 1], got 1.5."),
        ("tv_weight: -1\n", "tv_weight must be a finite number >= 0, got -1.0."),
        ("lr: [0.1\n", "is not readable YAML (while parsing a flow sequence"),
        ("lr: .inf\n", "lr must be a finite number > 0, got inf."),
        ("lr: .nan\n", "lr must be a finite number > 0, got nan."),
        ("max_grad_norm: -1\n", "max_grad_norm must be a finite number > 0"),
        ("checkpoint_freq: .inf\n", "checkpoint_freq must be a finite number > 0, got inf."),
        ("weight_decay: -0.1\n", "weight_decay must be a finite number >= 0, got -0.1."),
        ("scheduler_warmup_steps: 10\nmax_steps: 5\n", "scheduler_warmup_steps 10 is more than"),
        ("scheduler_warmup_ratio: 1.5\n",
         "scheduler_warmup_ratio must be a number in [0, 1], got 1.5."),
        ("scheduler_warmup_ratio: -0.1\n",
         "scheduler_warmup_ratio must be a number in [0, 1], got -0.1."),
        ("train_data_ratio: 0\n", "train_data_ratio must be a number in (0, 1] (1: no held-out"),
        ("train_data_ratio: 1.5\n", "train_data_ratio must be a number in (0, 1]"),
        ("train_data_ratio: .nan\n", "train_data_ratio must be a number in (0, 1]"),
        ("train_data_ratio: 0.9\nvalidation_data_path: .\n",
         "train_data_ratio 0.9 holds rows of data_path out for validation, and "
         "validation_data_path gives validation data too; use one of them"),
        ("train_data_ratio: 0.9\nonline: true\n",
         "train_data_ratio 0.9 needs offline data (hidden states on disk)"),
        ("save_best: true\n",
         "save_best needs validation_data_path or a train_data_ratio below 1 (speculators' "
         "default is 0.9, ours 1: no split)"),
        ("from_pretrained: 3\n", "from_pretrained must be of type str, got 3."),
    ],
)
def test_bad_files_fail_with_one_sentence(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_train_config(str(path), no_flags(**REQUIRED))


def test_required_paths():
    with pytest.raises(ValueError, match="verifier_name_or_path is required"):
        build_train_config(None, no_flags(data_path="/d"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"lr": "inf"}, "lr must be a finite number > 0, got inf."),
        ({"max_grad_norm": "-1"}, "max_grad_norm must be a finite number > 0"),
        ({"checkpoint_freq": "inf"}, "checkpoint_freq must be a finite number > 0, got inf."),
    ],
)
def test_optimizer_flags_out_of_range_are_one_sentence(flags, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        build_train_config(None, no_flags(**REQUIRED, **flags))


def test_max_grad_norm_none_turns_clipping_off():
    config = build_train_config(None, no_flags(**REQUIRED, max_grad_norm="none"))
    assert config.optimizer.max_grad_norm is None


def test_save_best_is_on_with_validation_unless_turned_off_and_free_without_it():
    """Without validation nothing is ranked: a save_best given as false is no contradiction,
    one left unset is not known to be meant; only true is refused (the table above)."""
    held_out = build_train_config(None, no_flags(**REQUIRED, train_data_ratio="0.9"))
    assert held_out.validating and held_out.trainer.validation.save_best is None  # None: on
    off = build_train_config(None, no_flags(**REQUIRED, save_best=False))
    assert not off.validating and off.trainer.validation.save_best is False
