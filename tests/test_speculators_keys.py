"""speculators' own train YAML runs with ``speculators-peagle train --config``; every key of
speculators' schema has an answer, and docs/speculators_keys.md is that table."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.training import DRAFT_VOCAB, run_cli
from speculators.train.config.artifacts import dump_yaml
from speculators.train.config.schema import TrainConfig as SpeculatorsConfig

from speculators_peagle_plugin.common.settings import leaves
from speculators_peagle_plugin.training import speculators_keys
from speculators_peagle_plugin.training.progress import METRICS_FILE
from speculators_peagle_plugin.training.train_config import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def speculators_keys_of_schema() -> list[str]:
    """Every key of speculators' TrainConfig, as "group.key" (root scalars bare)."""
    names = []
    for name, field in SpeculatorsConfig.model_fields.items():
        group = getattr(field.annotation, "model_fields", None)
        names += [f"{name}.{key}" for key in group] if group else [name]
    return names


def test_every_speculators_key_has_an_answer_and_works_ones_are_ours():
    schema = speculators_keys_of_schema()
    assert sorted(speculators_keys.SPECULATORS_KEYS) == sorted(schema) and len(schema) > 90
    ours = {leaf.key for leaf in leaves(TrainConfig)}
    for name, answer in speculators_keys.SPECULATORS_KEYS.items():
        assert answer.note or answer.kind() == "works", name
        if answer.ours is not None:
            assert answer.ours in ours, name
        if answer.accepted is not None and answer.ours is None:  # a fixed behaviour
            default = PEAGLE_DEFAULTS.get(name.rsplit(".", 1)[-1])
            assert answer.accepted, name
            assert default in answer.accepted, name


# speculators' defaults for a P-EAGLE run (some derive from speculator_type)
PEAGLE_DEFAULTS = SpeculatorsConfig.from_flat({"speculator_type": "peagle"}).flatten()


def test_the_docs_table_is_the_answers():
    page = (REPO / "docs" / "speculators_keys.md").read_text()
    assert speculators_keys.render_table() in page


@pytest.fixture(scope="module")
def workdir(tiny_workdir_once, tmp_path_factory):
    return shutil.copytree(tiny_workdir_once, tmp_path_factory.mktemp("spec-yaml") / "workdir")


def speculators_yaml(workdir, save, **more) -> str:
    """A P-EAGLE run.yaml as speculators writes it (its own dump: a ``train:`` block with
    the keys set, grouped)."""
    flat = {
        "speculator_type": "peagle", "seed": 3,
        "verifier_name_or_path": str(workdir / "target"), "data_path": str(workdir / "data"),
        "save_path": str(save), "total_seq_len": 96, "draft_vocab_size": DRAFT_VOCAB,
        "num_layers": 1, "epochs": 3, "max_steps": 4, "lr": 0.01, "optimizer": "adamw",
        "hidden_states_dtype": "float32", "num_depths": 3, "down_sample_ratio": 0.6,
        "max_anchors": 64, "log_freq": 2, "checkpoint_freq": 0.5, "num_workers": 2,
        "loss_implementation": "eager", "logger": "", **more,
    }
    return dump_yaml(SpeculatorsConfig.from_flat(flat))


def test_a_speculators_run_yaml_trains_unchanged(workdir, tmp_path):
    text = speculators_yaml(workdir, tmp_path / "save")
    assert text.startswith("train:\n") and "  data:\n" in text and "  peagle:\n" in text
    (tmp_path / "run.yaml").write_text(text)
    config = TrainConfig.from_sources(tmp_path / "run.yaml")
    assert (config.seed, config.optimizer.lr, config.peagle.cod.num_depths) == (3, 0.01, 3)
    assert (config.peagle.cod.down_sample_ratio, config.peagle.cod.max_anchors) == (0.6, 64)
    schedule = config.trainer.schedule
    assert (schedule.max_steps, schedule.epochs, config.logging.log_freq) == (4, 3, 2)
    assert config.runtime.autocast == "none" and config.data.total_seq_len == 96
    code, out = run_cli(["train", "--config", str(tmp_path / "run.yaml")])
    assert code == 0, out
    records = [json.loads(x) for x in (tmp_path / "save" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]  # its log_freq
    assert (tmp_path / "save" / "checkpoint-4" / "config.json").is_file()


def test_our_flat_and_sectioned_yaml_still_load(workdir, tmp_path):
    flat = {"verifier_name_or_path": str(workdir / "target"), "data_path": "d",
            "lr": 0.02, "fsdp": True, "keep_checkpoints": 2}
    grouped = {"verifier": {"verifier_name_or_path": str(workdir / "target")},
               "data": {"data_path": "d"}, "optimizer": {"lr": 0.02},
               "runtime": {"fsdp": True}, "trainer": {"keep_checkpoints": 2}}
    for i, mapping in enumerate((flat, grouped)):
        (tmp_path / f"{i}.yaml").write_text(yaml.safe_dump(mapping))
    assert TrainConfig.from_sources(tmp_path / "0.yaml") == TrainConfig.from_sources(
        tmp_path / "1.yaml"
    )


@pytest.mark.parametrize(("key", "value", "message"), [
    ("verifier.trust_remote_code", True, "speculators key verifier.trust_remote_code: True in "
     "RUN is not taken here (targets load with transformers' own architectures only); leave "
     "it out or give False."),
    ("draft.token_freq_path", "/f.pt", "speculators key draft.token_freq_path: '/f.pt' in RUN "
     "is not taken here (the draft vocabulary is counted from the data (its token_freq.pt)); "
     "leave it out."),
    ("speculator_type", "eagle3", "speculators key speculator_type: 'eagle3' in RUN is not "
     "taken here (this command trains P-EAGLE drafts (--algorithm)); leave it out or give "
     "peagle."),
])
def test_a_value_we_do_not_take_is_one_sentence(workdir, tmp_path, key, value, message):
    """speculators' defaults are left out of its run.yaml: a user writes them by hand."""
    mapping = yaml.safe_load(speculators_yaml(workdir, tmp_path / "save"))
    block = mapping["train"]
    *groups, name = key.split(".")
    for group in groups:
        block = block.setdefault(group, {})
    block[name] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(mapping))
    code, out = run_cli(["train", "--config", str(path)])
    assert code == 1
    assert out.strip().splitlines()[-1] == "Error: " + message.replace("RUN", str(path))
    assert not (tmp_path / "save").exists()


def test_keys_of_other_algorithms_warn_and_change_nothing(workdir, tmp_path, caplog):
    path, plain = tmp_path / "run.yaml", tmp_path / "plain.yaml"
    path.write_text(speculators_yaml(workdir, tmp_path / "save", block_size=4, ttt_steps=5))
    assert "dflash:" in path.read_text()
    plain.write_text(speculators_yaml(workdir, tmp_path / "save"))
    with caplog.at_level("WARNING"):
        config = TrainConfig.from_sources(path)
    assert config == TrainConfig.from_sources(plain)
    said = [r.getMessage() for r in caplog.records]
    assert any("dflash.block_size" in m and "has no effect here" in m for m in said)
    assert any("loss.ttt_steps" in m for m in said)
