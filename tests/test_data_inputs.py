"""generate-data's inputs on a tiny chat target: prompt files and sets, sampling settings,
and bad input refused in one sentence before anything is written.

Oracles: the prompt rows written out by hand, and greedy generation for the sampling knobs.
"""

import json

import pytest
import torch
from click.testing import CliRunner
from datasets import Dataset, load_from_disk
from helpers.chat_target import PROMPT_ROWS, gen_args, tiny_chat_target, write_prompt_rows

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data import load_prompts
from speculators_peagle_plugin.data.prompts import load_prompt_set, resolved_spec
from speculators_peagle_plugin.datagen import generation as gen_mod
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    return write_prompt_rows(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def test_generation_reads_prompts_through_the_eval_reader(prompts_path, tmp_path, monkeypatch):
    """One reader for both: every row shape, saved datasets, built-in sets and slices; for
    generation only the system/user turns are kept (the target writes every reply)."""
    expected = [sum(turns, []) for _, turns in PROMPT_ROWS if turns]
    assert load_prompts(prompts_path) == expected
    assert load_prompts(prompts_path, max_samples=2) == expected[:2]
    assert load_prompts(f"{prompts_path}[1:3]") == expected[1:3]  # usable rows are sliced
    assert load_prompts("chat[0:2]") == load_prompt_set("chat[0:2]").conversations
    rows = [
        "a plain string",
        {"instruction": "do this", "input": "with that"},
        {"prompt": [{"role": "user", "content": "listed"}, {"role": "tool", "content": "r"}]},
        {"messages": [{"role": "system", "content": ""}, {"from": "human", "value": "hi"}]},
    ]
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps(row) + "\n" for row in rows))
    user = [[{"role": "user", "content": t}] for t in ("a plain string", "do this\n\nwith that")]
    assert load_prompts(more) == [
        *user,
        *[[{"role": "user", "content": t}] for t in ("listed", "hi")],
    ]
    saved = tmp_path / "saved"
    Dataset.from_list([{"prompt": "x"}, {"prompt": "y"}]).save_to_disk(str(saved))
    assert load_prompts(saved) == [[{"role": "user", "content": t}] for t in "xy"]
    assert load_prompt_set(f"{saved}[1:]").conversations == [[{"role": "user", "content": "y"}]]
    monkeypatch.chdir(tmp_path)
    assert resolved_spec("more.jsonl") == str(more.resolve())
    assert resolved_spec("more.jsonl[1:2]") == f"{more.resolve()}[1:2]"
    assert resolved_spec("chat[1:]") == "chat[1:]"


def test_generate_data_takes_a_sliced_prompt_set(target_dir, prompts_path, tmp_path):
    out = tmp_path / "data"
    spec = f"{prompts_path}[3:5]"
    result = CliRunner().invoke(main, gen_args(target_dir, spec, out))
    assert result.exit_code == 0, result.output
    assert len(load_from_disk(str(out))) == 2  # two single-turn prompts
    settings = json.loads((out / "generation_settings.json").read_text())
    assert settings["prompts"] == f"{prompts_path.resolve()}[3:5]"


def test_sampling_is_seeded_and_overrides_the_checkpoints_defaults(target_dir, prompts_path):
    base = {"target": str(target_dir), "prompts": str(prompts_path), "output": "unused"}
    target = gen_mod.Target(DataGenConfig.from_sources(**base, max_new_tokens=8))
    with torch.no_grad():  # a peaked next-token distribution: low temperature == greedy
        target.model.lm_head.weight.mul_(40.0)
    prompts = [target.prompt_ids([{"role": "user", "content": t}]) for t in ("hello", "the fox")]

    def run(seed, **settings):
        target.config = DataGenConfig.from_sources(**base, max_new_tokens=8, **settings)
        replies = [None] * len(prompts)
        target.generate(prompts, [seed, seed + 1], lambda j, reply: replies.__setitem__(j, reply))
        return replies

    greedy = run(0)
    assert run(1) == greedy and run(0, temperature=0.01) == greedy
    sampled = run(5, temperature=1.0)
    assert sampled != greedy and run(5, temperature=1.0) == sampled != run(6, temperature=1.0)
    defaults = target.model.generation_config  # a checkpoint asking for near-greedy sampling
    defaults.do_sample, defaults.top_k, defaults.top_p, defaults.temperature = True, 1, 1e-6, 1e-3
    assert run(5, temperature=1.0) == sampled and run(0) == greedy


@pytest.fixture(scope="module")
def no_template_target(tmp_path_factory):
    path = tiny_chat_target(tmp_path_factory.mktemp("notemplate"), chat_template=False)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_prompts", "does not exist"),
        ("empty_prompts", "holds no usable prompt"),
        ("bad_json", "bad.jsonl:2 is not valid JSON"),
        ("layer_out_of_range", "--target-layer-ids must be integers in [0, 4)"),
        ("layer_not_int", "is not a comma-separated list of integers"),
        ("draft_vocab_too_big", "--draft-vocab-size 1000 exceeds the target's vocabulary size"),
        ("not_a_model", "is not a local transformers model directory"),
        ("negative_temperature", "temperature must be >= 0"),
        ("zero_top_p", "top_p must be in (0, 1]"),
        ("zero_batch", "batch_size must be an integer >= 1"),
        ("greedy_samples", "num_samples 2 needs temperature > 0"),
        ("hot_vllm", "with --backend vllm it must be in [0, 2.0]"),
        ("zero_kv_cache", "kv_cache_gb must be an integer >= 1"),
        ("no_chat_template", "has no chat template"),
    ],
)
def test_generate_data_rejects_bad_input(
    case, expected, target_dir, prompts_path, no_template_target, tmp_path
):
    out = tmp_path / "out"
    target, prompts, extra = target_dir, prompts_path, []
    if case == "missing_prompts":
        prompts = tmp_path / "nope.jsonl"
    elif case == "empty_prompts":
        prompts = tmp_path / "empty.jsonl"
        prompts.write_text('{"no_prompt": 1}\n\n')
    elif case == "bad_json":
        prompts = tmp_path / "bad.jsonl"
        prompts.write_text('{"prompt": "hi"}\n{"prompt": \n')
    elif case == "not_a_model":
        target = tmp_path
    elif case == "no_chat_template":
        target = no_template_target
    else:
        extra = {
            "layer_out_of_range": ["--target-layer-ids", "1,4"],
            "layer_not_int": ["--target-layer-ids", "1,x"],
            "draft_vocab_too_big": ["--draft-vocab-size", "1000"],
            "negative_temperature": ["--temperature", "-1"],
            "zero_top_p": ["--top-p", "0"],
            "zero_batch": ["--batch-size", "0"],
            "greedy_samples": ["--num-samples", "2"],
            "hot_vllm": ["--backend", "vllm", "--temperature", "3"],
            "zero_kv_cache": ["--backend", "vllm", "--kv-cache-gb", "0"],
        }[case]
    result = CliRunner().invoke(main, [*gen_args(target, prompts, out), *extra])
    assert result.exit_code != 0
    assert expected in result.output, result.output
    last = result.output.strip().splitlines()[-1]  # the error is one line, the last
    assert last.startswith("Error") and expected in last, result.output
    assert not out.exists()  # nothing half-written
