"""eval/side_by_side.py's two training sides on a tiny target (its vLLM eval needs a real one).

Both sides start from the same draft and see the same rows and the same per-step seeds, so
speculators' own P-EAGLE loss, trained in the minimal loop, is an oracle for ours: the
losses of every step agree, and so do the trained weights.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_workdir

sys.path.insert(0, str(Path(__file__).parent.parent))  # the repo root: eval/ is not installed
from eval import demo_run, side_by_side  # noqa: E402


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tiny_workdir(tmp_path_factory.mktemp("sbs"))
    config = root / "tiny.yaml"
    config.write_text(
        "num_depths: 3\ndraft_vocab_size: 40\ntotal_seq_len: 96\nsequence_partitions: 1\n"
        "lr: 0.003\nscheduler_warmup_steps: 0\n"
    )
    return {
        "target": str(root / "target"), "data": str(root / "data"), "config": str(config),
        "steps": 4, "out": str(root / "out"), "threads": 1,
    }


def test_both_sides_train_the_same_draft_alike(spec):
    ours = side_by_side.train_ours(spec)
    theirs = side_by_side.train_theirs(spec)
    assert ours["steps"] == theirs["steps"] == 4
    assert ours["train_s"] > 0 and theirs["train_s"] > 0
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-4, atol=1e-7
    )
    assert ours["losses"][-1] < ours["losses"][0]  # the steps trained something
    mine = load_file(f"{ours['draft']}/model.safetensors")
    other = load_file(f"{theirs['draft']}/model.safetensors")
    trained = [k for k in mine if "layers." in k]
    assert trained and set(trained) <= set(other)
    for key in trained:
        torch.testing.assert_close(mine[key], other[key], rtol=1e-3, atol=1e-5)
    for side in (ours, theirs):
        config = json.loads(open(f"{side['draft']}/config.json").read())
        assert config["speculators_model_type"] == "peagle"


def test_a_seed_replicates_the_comparison_on_both_sides(spec, tmp_path):
    """``--seed``: another initial draft, row order and COD samples, alike on both sides."""
    default = side_by_side.train_ours(dict(spec, out=str(tmp_path / "default"), steps=2))
    seeded = dict(spec, out=str(tmp_path / "seeded"), steps=2, seed=7)
    ours, theirs = side_by_side.train_ours(seeded), side_by_side.train_theirs(seeded)
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-4, atol=1e-7
    )
    assert abs(ours["losses"][0] - default["losses"][0]) > 1e-3  # not the YAML's seed


def test_partitioned_ours_matches_theirs_too(spec, tmp_path):
    """Sequence partitions change how ours computes the loss, not what it is."""
    config = tmp_path / "partitioned.yaml"
    text = open(spec["config"]).read().replace("sequence_partitions: 1", "sequence_partitions: 3")
    config.write_text(text)
    spec = dict(spec, config=str(config), out=str(tmp_path / "out"), steps=2)
    ours, theirs = side_by_side.train_ours(spec), side_by_side.train_theirs(spec)
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-4, atol=1e-7
    )


@pytest.mark.parametrize(
    "key, theirs_value, speculators_default",
    [("max_anchors", 8, 512), ("down_sample_ratio", 0.3, 0.7)],  # speculators 0.9.0's defaults
)
def test_theirs_cod_knobs_are_their_own_and_our_config_else(
    spec, tmp_path, key, theirs_value, speculators_default
):
    """The chain cap and the COD ratio reach their sampler: with ours' (none) both sides
    agree; with a cap below the rows' supervised positions, or another ratio, theirs samples
    other chains and its losses move."""
    same = dict(spec, out=str(tmp_path / "same"), steps=2, **{f"theirs_{key}": None})
    other = dict(spec, out=str(tmp_path / "other"), steps=2, **{f"theirs_{key}": theirs_value})
    ours = torch.tensor(side_by_side.train_ours(same)["losses"])
    torch.testing.assert_close(
        torch.tensor(side_by_side.train_theirs(same)["losses"]), ours, rtol=1e-4, atol=1e-7
    )
    theirs = torch.tensor(side_by_side.train_theirs(other)["losses"])
    assert (theirs - ours).abs().max() > 1e-3
    assert getattr(side_by_side, f"_speculators_{key}")() == speculators_default


def test_theirs_draft_speculators_is_the_draft_speculators_train_builds(spec, tmp_path):
    """With the recipe's verifier start and 4 key/value heads, ``theirs_draft="speculators"``
    trains what ``speculators train`` builds instead: a random layer (another first loss)
    with the verifier's 2 key/value heads; ours keeps the recipe."""
    config = tmp_path / "recipe.yaml"
    recipe_keys = "draft_init: verifier\nnum_key_value_heads: 4\n"
    config.write_text(open(spec["config"]).read() + recipe_keys)
    each = dict(spec, config=str(config), out=str(tmp_path / "same"), steps=1)
    ours, same = side_by_side.train_ours(each), side_by_side.train_theirs(each)
    builtin = dict(each, out=str(tmp_path / "builtin"), theirs_draft="speculators")
    theirs = side_by_side.train_theirs(builtin)
    torch.testing.assert_close(torch.tensor(same["losses"]), torch.tensor(ours["losses"]),
                               rtol=1e-4, atol=1e-7)
    assert abs(theirs["losses"][0] - ours["losses"][0]) > 1e-3  # another initial draft

    def kv_heads(side):
        layer = json.loads(open(f"{side['draft']}/config.json").read())
        return layer["transformer_layer_config"]["num_key_value_heads"]

    assert kv_heads(ours) == kv_heads(same) == 4 and kv_heads(theirs) == 2  # tiny target: 2
    # theirs' config: speculators' construction (the TrainConfig defaults) in every key
    recipe = side_by_side._train_config(each, "ours").to_dict()
    defaults = side_by_side._train_config(builtin, "theirs").to_dict()
    assert all(recipe[k] != defaults[k] for k in side_by_side.SPECULATORS_DRAFT)
    assert (defaults["draft_init"], defaults["num_key_value_heads"]) == ("random", None)


def test_both_sides_train_alike_under_autocast(spec, tmp_path):
    """The YAML's mixed precision reaches both sides: their losses move off float32's
    together (bfloat16 products of different shapes: close, not equal)."""
    config = tmp_path / "autocast.yaml"
    config.write_text(open(spec["config"]).read() + "autocast: bfloat16\n")
    runs = {}
    for name, cfg in (("float32", spec["config"]), ("bfloat16", str(config))):
        each = dict(spec, config=cfg, out=str(tmp_path / name), steps=2)
        runs[name] = [torch.tensor(side(each)["losses"])
                      for side in (side_by_side.train_ours, side_by_side.train_theirs)]
    (ours32, theirs32), (ours16, theirs16) = runs["float32"], runs["bfloat16"]
    torch.testing.assert_close(ours16, theirs16, rtol=5e-3, atol=0)
    for low, full in ((ours16, ours32), (theirs16, theirs32)):
        assert not torch.equal(low, full)
        torch.testing.assert_close(low, full, rtol=2e-2, atol=0)


def test_no_finished_demo_is_one_sentence(tmp_path):
    with pytest.raises(SystemExit, match="run `make demo` first"):
        demo_run.demo_inputs(tmp_path)


def test_the_demo_is_read_from_its_own_directory_wherever_this_runs(tmp_path, monkeypatch):
    # stages.json records paths relative to where the demo ran (here: tmp_path/repo)
    demo = tmp_path / "repo" / "runs" / "demo"
    (demo / "data").mkdir(parents=True)
    stages = {"target": {"outputs": {"path": "/models/target"}},
              "data": {"inputs": {"dtype": "bfloat16"},
                       "outputs": {"path": "runs/demo/data"}}}
    (demo / "stages.json").write_text(json.dumps(stages))
    config = {"train_config": "configs/demo.yaml", "max_steps": None, "max_new_tokens": 16,
              "gen_batch_size": 32, "eval_max_new_tokens": 8, "eval_concurrency": [1, 2],
              "kv_cache_gb": 1, "num_speculative_tokens": 4, "eval_prompts": ["humaneval[0:2]"]}
    (demo / "demo.json").write_text(json.dumps({"config": config}))
    (tmp_path / "elsewhere" / "runs" / "demo" / "data").mkdir(parents=True)  # a decoy
    monkeypatch.chdir(tmp_path / "elsewhere")
    inputs = demo_run.demo_inputs(Path("../repo/runs/demo"))
    assert inputs["data"] == str((demo / "data").resolve())
    assert inputs["target"] == "/models/target" and inputs["k"] == 4
    assert inputs["gen_batch_size"] == 32
    assert inputs["dtype"] == "bfloat16"  # the drafts are served in the data's dtype
    assert inputs["trained"] is None and inputs["native_bf16"]  # it never trained
