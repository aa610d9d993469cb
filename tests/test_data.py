"""generate-data end to end on a tiny chat target: the rows, replies and hidden states it
writes, and how a rerun resumes.

Oracles: speculators' own readers and checks (ArrowDataset, check_hidden_states,
build_vocab_mappings_from_distribution), an independent transformers forward and unbatched
greedy generation.
"""

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from helpers.chat_target import (
    HIDDEN,
    LAYER_IDS,
    MAX_NEW,
    PROMPT_ROWS,
    VOCAB,
    gen_args,
    write_prompt_rows,
)
from helpers.stops import stopped_at_call
from safetensors.torch import load_file, save_file
from speculators.data_generation.offline import check_hidden_states
from speculators.train.data import ArrowDataset
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoTokenizer, LlamaForCausalLM

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.files import TMP_MARK
from speculators_peagle_plugin.data import open_training_data
from speculators_peagle_plugin.datagen import capture as capture_mod
from speculators_peagle_plugin.datagen import generation as gen_mod
from speculators_peagle_plugin.datagen.build_data import generate_data
from speculators_peagle_plugin.datagen.capture import capture_hidden_states
from speculators_peagle_plugin.datagen.datagen_config import DataGenConfig
from speculators_peagle_plugin.datagen.generation import completion_tokens


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    return write_prompt_rows(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def generated(tmp_path_factory, target_dir, prompts_path):
    out = tmp_path_factory.mktemp("gen") / "data"
    result = CliRunner().invoke(main, gen_args(target_dir, prompts_path, out))
    assert result.exit_code == 0, result.output
    return out


def hs_files(path):
    return sorted((Path(path) / "hidden_states").iterdir())


def leftovers(path):
    """What an interrupted atomic write leaves (common.files' temporary names)."""
    return [p for p in Path(path).rglob("*") if TMP_MARK in p.name]


# ---------------------------------------------------------------------------------------------
# generate-data
# ---------------------------------------------------------------------------------------------


def test_generate_data_cli_writes_speculators_format(generated):
    dataset = load_from_disk(str(generated))
    n = len(dataset)
    assert n == sum(len(turns) for _, turns in PROMPT_ROWS if turns)
    assert {"input_ids", "loss_mask", "seq_len"} <= set(dataset.column_names)
    assert [p.name for p in hs_files(generated)] == sorted(f"hs_{i}.safetensors" for i in range(n))
    assert not leftovers(generated) and not (generated / "responses").exists()

    # speculators' own reader, strict: every sample loads, with the packed shapes.
    reader = ArrowDataset(max_len=512, datapath=generated, on_missing="raise")
    for i in range(n):
        row = dataset[i]
        assert int(row["seq_len"]) == len(row["input_ids"]) == len(row["loss_mask"])
        raw = load_file(generated / "hidden_states" / f"hs_{i}.safetensors")
        check_hidden_states(raw, row["input_ids"].tolist())  # speculators' validator
        assert raw["hidden_states"].shape == (len(row["input_ids"]), len(LAYER_IDS) + 1, HIDDEN)
        assert raw["hidden_states"].dtype == torch.float32 and raw["token_ids"].dtype == torch.int64
        item = reader[i]
        assert item["hidden_states"].shape == (len(row["input_ids"]), len(LAYER_IDS) * HIDDEN)
        assert item["verifier_last_hidden_states"].shape == (len(row["input_ids"]), HIDDEN)
        assert torch.equal(item["loss_mask"], row["loss_mask"])

    # token_freq.pt counts supervised tokens only; d2t/t2d are speculators' mapping of it.
    freq = torch.load(generated / "token_freq.pt", weights_only=True)
    expected = Counter()
    for row in dataset:
        expected.update(row["input_ids"][row["loss_mask"].bool()].tolist())
    assert freq == dict(expected)
    d2t = torch.from_numpy(np.load(generated / "d2t-40.npy"))
    t2d = torch.from_numpy(np.load(generated / "t2d-40.npy"))
    ref_d2t, ref_t2d = build_vocab_mappings_from_distribution(freq, 40, VOCAB)
    assert torch.equal(d2t, ref_d2t) and torch.equal(t2d, ref_t2d)
    assert torch.equal(t2d.nonzero().flatten(), torch.arange(40) + d2t)  # d2t holds offsets

    settings = json.loads((generated / "generation_settings.json").read_text())
    assert settings["target_layer_ids"] == list(LAYER_IDS)
    assert [settings[k] for k in ("max_new_tokens", "temperature", "seed")] == [MAX_NEW, 0, 0]
    data = open_training_data(generated, draft_vocab_size=40, verifier_hidden_size=HIDDEN)
    assert data.target_layer_ids == LAYER_IDS and data.num_aux_layers == len(LAYER_IDS)
    assert data.num_loss_tokens == sum(expected.values())


def test_rows_are_the_targets_greedy_replies_and_loss_mask_marks_only_them(generated, target_dir):
    """Oracle: unbatched greedy generate per turn, with the previous replies in the history."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = []
    for _, turns in PROMPT_ROWS:
        history = []
        for new_turns in turns or []:
            history += new_turns
            prompt = tokenizer.apply_chat_template(
                history, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                    eos_token_id=eos, pad_token_id=0,
                )
            reply = out[0, len(prompt) :].tolist()
            reply = reply[: reply.index(eos) + 1] if eos in reply else reply
            expected.append((list(prompt), reply))
            history.append(
                {"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)}
            )
    dataset = load_from_disk(str(generated))
    assert len(dataset) == len(expected)
    for row, (prompt, reply) in zip(dataset, expected, strict=True):
        assert row["input_ids"].tolist() == prompt + reply
        assert row["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(reply)
        # the prompt is the chat template's context: it ends with the assistant header
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")


def test_hidden_states_equal_an_independent_forward(generated, target_dir):
    """Aux slot k = transformers' hidden_states[L_k]; last slot = last decoder layer's output,
    i.e. BEFORE the final norm (the norm of it is transformers' hidden_states[-1])."""
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    last_layer = []
    model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: last_layer.append(out[0] if isinstance(out, tuple) else out)
    )
    for i, path in enumerate(hs_files(generated)):
        saved = load_file(path)
        ids = saved["token_ids"]
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        for slot, layer in enumerate(LAYER_IDS):
            torch.testing.assert_close(saved["hidden_states"][:, slot], out.hidden_states[layer][0])
        pre_norm = saved["hidden_states"][:, -1]
        torch.testing.assert_close(pre_norm, last_layer[-1][0])
        with torch.no_grad():
            torch.testing.assert_close(model.model.norm(pre_norm), out.hidden_states[-1][0])
        assert not torch.allclose(pre_norm, out.hidden_states[-1][0], atol=1e-2), i


def test_rows_sharing_a_prefix_get_the_states_of_their_own_full_forward(target_dir):
    """The samples of one prompt share its forward (one KV cache, cropped back per row)."""
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    forwards = []
    model.model.register_forward_pre_hook(lambda _m, _a, kw: forwards.append(1), with_kwargs=True)
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    prefix = tokens(40)
    rows = [prefix + tokens(5), prefix + tokens(1), prefix + tokens(12), tokens(30), tokens(9)]
    states_of = capture_mod._PrefixStates(model, LAYER_IDS)
    for i, row in enumerate(rows):
        got = states_of(row, rows[i + 1] if i + 1 < len(rows) else None)
        with torch.no_grad():
            expected = capture_hidden_states(model, torch.tensor(row), LAYER_IDS)
        torch.testing.assert_close(got, expected)
    # prefix once + 3 continuations + 2 unshared rows, + one reference forward per row
    assert len(forwards) == 1 + 3 + 2 + len(rows)


def test_completion_is_cut_after_the_first_eos():
    assert completion_tokens([5, 7, 2, 2, 2], [2]) == [5, 7, 2]
    assert completion_tokens([5, 9, 7, 0], [2, 9]) == [5, 9]
    assert completion_tokens([5, 7, 8], [2]) == [5, 7, 8]  # hit max_new_tokens


def stat(path):
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


def test_resume_rewrites_only_missing_or_bad_hidden_state_files(
    generated, target_dir, prompts_path, tmp_path, monkeypatch
):
    out = tmp_path / "data"
    shutil.copytree(generated, out)
    hs = out / "hidden_states"
    originals = {p.name: load_file(p) for p in hs_files(generated)}
    (hs / "hs_1.safetensors").unlink()  # never written
    raw = (hs / "hs_3.safetensors").read_bytes()
    (hs / "hs_3.safetensors").write_bytes(raw[: len(raw) // 2])  # truncated by a copy
    wrong = dict(originals["hs_4.safetensors"])
    wrong["token_ids"] = wrong["token_ids"].flip(0).contiguous()
    save_file(wrong, hs / "hs_4.safetensors")  # another sample's file
    # what writers killed mid-write leave: a file and the dataset's staging directory
    (hs / f".hs_2.safetensors{TMP_MARK}4242").write_bytes(b"killed mid-write")
    (out / f".dataset{TMP_MARK}4242").mkdir()
    (out / f".dataset{TMP_MARK}4242" / "state.json").write_text("{}")
    rewritten = {"hs_1.safetensors", "hs_3.safetensors", "hs_4.safetensors"}
    kept = {
        p.relative_to(out): stat(p)
        for p in out.rglob("*")
        if p.is_file() and p.name not in rewritten and TMP_MARK not in str(p)
    }

    def no_generation(*args, **kwargs):
        raise AssertionError("the replies are complete; nothing must be regenerated")

    monkeypatch.setattr(gen_mod.Target, "generate", no_generation)
    result = CliRunner().invoke(main, gen_args(target_dir, prompts_path, out))
    assert result.exit_code == 0, result.output
    assert [p.name for p in hs_files(out)] == sorted(originals)
    for name, tensors in originals.items():
        again = load_file(hs / name)
        assert torch.equal(again["token_ids"], tensors["token_ids"])
        torch.testing.assert_close(again["hidden_states"], tensors["hidden_states"])
    for rel, before in kept.items():  # complete, valid files untouched
        assert stat(out / rel) == before, rel
    assert not leftovers(out)


def test_resume_after_interrupted_generation_skips_finished_batches(
    generated, target_dir, prompts_path, tmp_path, monkeypatch
):
    out = tmp_path / "data"
    config = DataGenConfig.from_sources(
        target=str(target_dir), prompts=str(prompts_path), output=str(out),
        max_new_tokens=MAX_NEW, batch_size=2, target_layer_ids=LAYER_IDS, draft_vocab_size=40,
    )
    real = gen_mod._regenerate
    # interrupted in the second batch; a call's note: its number of conversations
    with stopped_at_call(monkeypatch, gen_mod, "_regenerate", 2, lambda *a: len(a[1])) as calls:
        generate_data(config)
    assert len(list((out / "responses").glob("*.json"))) == 1
    assert not (out / "state.json").exists() and not (out / "hidden_states").exists()

    calls.clear()
    monkeypatch.setattr(gen_mod, "_regenerate",
                        lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    data = generate_data(config)
    n_prompts = sum(1 for _, turns in PROMPT_ROWS if turns)
    assert sum(calls) == n_prompts - 2  # the first batch of 2 was not regenerated
    ours = load_from_disk(str(out)).with_format(None)
    full = load_from_disk(str(generated)).with_format(None)
    assert ours["input_ids"] == full["input_ids"] and ours["loss_mask"] == full["loss_mask"]
    assert data.num_samples == len(full)


def test_a_run_killed_while_writing_its_settings_resumes(generated, target_dir, prompts_path,
                                                         tmp_path):
    """What a SIGKILL in the first write leaves (the dead run's lock, its settings' temporary)
    is no foreign directory: the same command makes the uninterrupted run's data."""
    from helpers.results import data_rows

    out = tmp_path / "data"
    out.mkdir()
    (out / ".lock").write_text("999999\n")
    (out / f".generation_settings.json{TMP_MARK}999999").write_text('{"tar')
    result = CliRunner().invoke(main, gen_args(target_dir, prompts_path, out))
    assert result.exit_code == 0, result.output
    assert data_rows(out) == data_rows(generated)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_resume_refuses_other_settings_or_a_foreign_directory(
    generated, target_dir, prompts_path, tmp_path
):
    out = tmp_path / "data"
    shutil.copytree(generated, out)
    before = {p: stat(p) for p in out.rglob("*")}
    result = CliRunner().invoke(
        main, [*gen_args(target_dir, prompts_path, out), "--max-new-tokens", "7"]
    )
    assert result.exit_code != 0
    assert "was made with different settings (max_new_tokens: 6 there, 7 now)" in result.output
    assert {p: stat(p) for p in out.rglob("*")} == before

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, gen_args(target_dir, prompts_path, foreign))
    assert result.exit_code != 0 and "was not made by generate-data" in result.output
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
