"""Data: generate-data end to end on a tiny chat target, speculators-format interop, packing.

Oracles: speculators' own readers/writers (ArrowDataset, CollateFn, check_hidden_states,
build_vocab_mappings_from_distribution, prepare-data), an independent transformers forward and
unbatched greedy generation, and packed rows rebuilt by hand from the files.
"""

import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from datasets import Dataset, Features, Sequence, Value, load_from_disk
from safetensors.torch import load_file, save_file
from speculators.data_generation.offline import check_hidden_states
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.vocab_mapping import (
    build_vocab_mappings_from_distribution,
    save_token_frequency_distribution,
)
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.common.files import TMP_MARK
from speculators_peagle_plugin.data import (
    DataError,
    DataGenConfig,
    PackedBatches,
    capture_hidden_states,
    completion_tokens,
    generate_data,
    load_prompts,
    open_training_data,
    pack_rows,
)
from speculators_peagle_plugin.data import capture as capture_mod
from speculators_peagle_plugin.data import generation as gen_mod
from speculators_peagle_plugin.data.prompts import load_prompt_set, resolved_spec

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB, HIDDEN, LAYERS, LAYER_IDS, MAX_NEW = 320, 64, 4, (1, 2, 3), 6

# Expected regeneration turns per usable row (assistant turns dropped, from/value mapped).
PROMPT_ROWS = [
    ({"prompt": "hello world"}, [[{"role": "user", "content": "hello world"}]]),
    (
        {
            "messages": [
                {"role": "system", "content": "be kind"},
                {"role": "user", "content": "how are you"},
                {"role": "assistant", "content": "recorded reply, ignored"},
                {"role": "user", "content": "the quick fox"},
            ]
        },
        [
            [{"role": "system", "content": "be kind"}, {"role": "user", "content": "how are you"}],
            [{"role": "user", "content": "the quick fox"}],
        ],
    ),
    (
        {"conversations": [{"from": "human", "value": "quick brown"},
                           {"from": "gpt", "value": "x"}]},
        [[{"role": "user", "content": "quick brown"}]],
    ),
    ({"no_prompt_here": 1}, None),
    ({"prompt": "fox, how are you?"}, [[{"role": "user", "content": "fox, how are you?"}]]),
    ({"prompt": "are"}, [[{"role": "user", "content": "are"}]]),
]  # fmt: skip


def tiny_chat_target(path: Path, seed: int = 0, chat_template: bool = True) -> Path:
    """A 4-layer random llama with a small byte-level BPE tokenizer and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["hello world, how are you?", "the quick brown fox"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML if chat_template else None,
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=LAYERS, vocab_size=VOCAB, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def gen_args(target, prompts, output, *extra):
    return [
        "generate-data", "--target", str(target), "--prompts", str(prompts), "--output",
        str(output), "--max-new-tokens", str(MAX_NEW), "--batch-size", "3",
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)), "--draft-vocab-size", "40", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_chat_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def prompts_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row, _ in PROMPT_ROWS) + "\n")
    return path


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
                )  # fmt: skip
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
    target = gen_mod.Target(DataGenConfig(**base, max_new_tokens=8))
    with torch.no_grad():  # a peaked next-token distribution: low temperature == greedy
        target.model.lm_head.weight.mul_(40.0)
    prompts = [target.prompt_ids([{"role": "user", "content": t}]) for t in ("hello", "the fox")]

    def run(seed, **settings):
        target.config = DataGenConfig(**base, max_new_tokens=8, **settings)
        return target.generate(prompts, seed)

    greedy = run(0)
    assert run(1) == greedy and run(0, temperature=0.01) == greedy
    sampled = run(5, temperature=1.0)
    assert sampled != greedy and run(5, temperature=1.0) == sampled != run(6, temperature=1.0)
    defaults = target.model.generation_config  # a checkpoint asking for near-greedy sampling
    defaults.do_sample, defaults.top_k, defaults.top_p, defaults.temperature = True, 1, 1e-6, 1e-3
    assert run(5, temperature=1.0) == sampled and run(0) == greedy


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
    config = DataGenConfig(
        target=str(target_dir), prompts=str(prompts_path), output=str(out),
        max_new_tokens=MAX_NEW, batch_size=2, target_layer_ids=LAYER_IDS, draft_vocab_size=40,
    )  # fmt: skip
    real = gen_mod._regenerate
    calls = []

    def interrupted(target, conversations, seed):
        calls.append(len(conversations))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(target, conversations, seed)

    monkeypatch.setattr(gen_mod, "_regenerate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate_data(config)
    assert len(list((out / "responses").glob("*.json"))) == 1
    assert not (out / "state.json").exists() and not (out / "hidden_states").exists()

    calls.clear()
    monkeypatch.setattr(gen_mod, "_regenerate", lambda *a: calls.append(len(a[1])) or real(*a))
    data = generate_data(config)
    n_prompts = sum(1 for _, turns in PROMPT_ROWS if turns)
    assert sum(calls) == n_prompts - 2  # the first batch of 2 was not regenerated
    ours = load_from_disk(str(out)).with_format(None)
    full = load_from_disk(str(generated)).with_format(None)
    assert ours["input_ids"] == full["input_ids"] and ours["loss_mask"] == full["loss_mask"]
    assert data.num_samples == len(full)


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


# ---------------------------------------------------------------------------------------------
# Reading: synthetic speculators-format data
# ---------------------------------------------------------------------------------------------

H_SYN, AUX_SYN, VOCAB_SYN = 8, 3, 50


def write_data(path, lengths, seed=0, dtype=torch.float32, token_freq=True):
    """Speculators-format data with random tokens, supervision and hidden states."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB_SYN, (n,), generator=gen) for n in lengths]
    masks = [(torch.rand(n, generator=gen) < 0.6).long() for n in lengths]
    features = Features(
        {"input_ids": Sequence(Value("int64")), "loss_mask": Sequence(Value("int64")),
         "seq_len": Value("int64")}
    )  # fmt: skip
    dataset = Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "seq_len": list(lengths)}, features=features
    )
    dataset.set_format("torch")
    dataset.save_to_disk(str(path))
    (path / "hidden_states").mkdir()
    for i, n in enumerate(lengths):
        hidden = torch.randn(n, AUX_SYN + 1, H_SYN, generator=gen).to(dtype)
        save_file({"hidden_states": hidden, "token_ids": ids[i]}, hs_path(path, i))
    if token_freq and len(lengths):
        save_token_frequency_distribution(dataset, path / "token_freq.pt")
    return path


def hs_path(path, i):
    return Path(path) / "hidden_states" / f"hs_{i}.safetensors"


def expected_row(path, dataset, samples, seq_len):
    """A packed row rebuilt by hand from the files (the oracle for PackedBatches).

    Each sample is shifted first (speculators' ``shift_batch``): slot t holds token t+1,
    aux states at t, the last state at t+1 and position t+1.
    """
    ids, aux, last, mask, pos, docs, lengths = [], [], [], [], [], [], []
    for doc, i in enumerate(samples):
        n = min(len(dataset[i]["input_ids"]) - 1, seq_len - len(ids))
        hidden = load_file(hs_path(path, i))["hidden_states"].float()
        ids += dataset[i]["input_ids"][1 : n + 1].tolist()
        mask += dataset[i]["loss_mask"][1 : n + 1].tolist()
        aux.append(hidden[:n, :-1].flatten(1))
        last.append(hidden[1 : n + 1, -1])
        pos += list(range(1, n + 1))
        docs += [doc] * n
        lengths.append(n)
    pad = seq_len - len(ids)
    return {
        "input_ids": torch.tensor(ids + [0] * pad)[None],
        "loss_mask": torch.tensor(mask + [0] * pad)[None],
        "position_ids": torch.tensor(pos + [0] * pad)[None],
        "document_ids": torch.tensor(docs + [-1] * pad)[None],
        "hidden_states": torch.cat([*aux, torch.zeros(pad, AUX_SYN * H_SYN)])[None],
        "verifier_last_hidden_states": torch.cat([*last, torch.zeros(pad, H_SYN)])[None],
        "lengths": torch.tensor(lengths, dtype=torch.long),
    }


def assert_batch_equal(got, want):
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


@pytest.fixture(scope="module")
def syn_lengths():
    gen = torch.Generator().manual_seed(7)
    return torch.randint(1, 66, (37,), generator=gen).tolist()


@pytest.fixture(scope="module")
def syn_data(tmp_path_factory, syn_lengths):
    return write_data(tmp_path_factory.mktemp("syn") / "data", syn_lengths)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_packing_invariants(syn_data, syn_lengths, seed, world_size):
    seq_len = 50  # some samples (up to 65 tokens) are longer: truncated, alone in their row
    data = open_training_data(syn_data)
    ranks = [
        PackedBatches(data, seq_len, seed=seed, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    clipped = [min(n, seq_len) for n in syn_lengths]
    steps = len(ranks[0])
    assert all(len(pb) == steps for pb in ranks)
    assert steps == math.ceil(ranks[0].num_rows / world_size)
    # best-fit decreasing uses at most 11/9 OPT + 1 rows, and OPT >= ceil(tokens / S)
    assert ranks[0].num_rows <= 11 / 9 * math.ceil(sum(clipped) / seq_len) + 1
    dataset = load_from_disk(str(syn_data))
    orders = []
    for epoch in (0, 1):
        seen = []
        for step in range(steps):
            rows = ranks[0].global_rows(epoch, step)
            for r, pb in enumerate(ranks):
                samples = pb.step_samples(epoch, step)
                assert sum(clipped[i] for i in samples) <= seq_len
                assert sum(syn_lengths[i] for i in samples) <= seq_len or len(samples) == 1
                want = expected_row(syn_data, dataset, samples, seq_len)
                assert_batch_equal(pb.batch(epoch, step), want)
                assert_batch_equal(rows[r], want)
                seen += samples
        assert sorted(seen) == list(range(len(syn_lengths)))  # once per epoch, ranks disjoint
        orders.append(ranks[0].rows(epoch))
        assert len(orders[-1]) == ranks[0].num_rows  # same number of rows every epoch
    assert orders[0] != orders[1]  # reshuffled per epoch
    again = PackedBatches(data, seq_len, seed=seed, world_size=world_size)
    assert again.rows(1) == orders[1] and again.rows(0) == orders[0]  # deterministic
    other = PackedBatches(data, seq_len, seed=seed + 10, world_size=world_size)
    assert other.rows(0) != orders[0]
    fixed = PackedBatches(data, seq_len, seed=seed, world_size=world_size, shuffle=False)
    assert fixed.rows(0) == fixed.rows(5)


def test_last_step_pads_ranks_without_a_row(syn_data):
    data = open_training_data(syn_data)
    world = PackedBatches(data, 50, seed=0).num_rows + 1  # more ranks than rows
    pb = PackedBatches(data, 50, seed=0, world_size=world)
    assert len(pb) == 1
    rows = pb.global_rows(0, 0)
    empty = rows[-1]
    assert (empty["document_ids"] == -1).all() and (empty["loss_mask"] == 0).all()
    assert empty["lengths"].numel() == 0 and empty["loss_mask"].dtype == torch.long
    assert empty["hidden_states"].shape == (1, 50, AUX_SYN * H_SYN)
    with pytest.raises(IndexError, match="outside this epoch's"):
        pb.batch(0, len(pb))
    with pytest.raises(ValueError, match="rank must be an integer in"):
        PackedBatches(data, 50, seed=0, rank=4, world_size=4)
    with pytest.raises(ValueError, match="total_seq_len must be an integer >= 1"):
        PackedBatches(data, 0, seed=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_rows_count_does_not_depend_on_order(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (200,), generator=gen).tolist()
    counts = set()
    for _ in range(5):
        order = torch.randperm(200, generator=gen).tolist()
        rows = pack_rows(lengths, 100, order)
        assert sorted(i for row in rows for i in row) == list(range(200))
        assert all(sum(min(lengths[i], 100) for i in row) <= 100 for row in rows)
        counts.add(len(rows))
    assert len(counts) == 1
    assert pack_rows([5, 3, 4, 2], 8, [0, 1, 2, 3]) == [[0, 1], [2, 3]]


def test_vocab_mapping_built_from_token_freq_and_cached(tmp_path, syn_lengths):
    path = write_data(tmp_path / "data", syn_lengths)
    data = open_training_data(path, draft_vocab_size=16)  # checks a source exists, builds nothing
    assert not (path / "d2t-16.npy").exists()
    with pytest.raises(DataError, match="needs the target's vocabulary size"):
        data.vocab_mapping(16)
    d2t, t2d = data.vocab_mapping(16, target_vocab_size=VOCAB_SYN)
    freq = torch.load(path / "token_freq.pt", weights_only=True)
    ref = build_vocab_mappings_from_distribution(freq, 16, VOCAB_SYN)
    assert torch.equal(d2t, ref[0]) and torch.equal(t2d, ref[1])
    assert (path / "d2t-16.npy").exists() and (path / "t2d-16.npy").exists()
    again = open_training_data(path, draft_vocab_size=16).vocab_mapping(16)
    assert torch.equal(again[0], d2t) and torch.equal(again[1], t2d)
    # a size not yet on disk: the target vocabulary size now comes from t2d-16.npy
    assert data.vocab_mapping(20)[1].shape == (VOCAB_SYN,)
    with pytest.raises(DataError, match="exceeds the target's vocabulary size"):
        data.vocab_mapping(VOCAB_SYN + 1)
    np.save(path / "d2t-16.npy", np.zeros(16, dtype=np.int64))  # inconsistent with t2d
    with pytest.raises(DataError, match="do not describe a 16-token draft vocabulary"):
        data.vocab_mapping(16)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_path", "is not an existing directory"),
        ("empty_path", "is not an existing directory"),
        ("empty_dir", "holds no dataset saved with save_to_disk"),
        ("no_rows", "is empty"),
        ("missing_column", "lacks the column(s) ['seq_len']"),
        ("bad_seq_len", "they must agree"),
        ("missing_hs", "lacks the hidden states of 1 of 6 rows (first: hs_2.safetensors)"),
        ("hidden_size", "holds hidden states of size 8 (hs_0.safetensors) but the verifier's"),
        ("aux_layers", "holds 3 aux hidden states per token (hs_0.safetensors) but 4"),
        ("no_vocab_source", "nor token_freq.pt to build a 16-token draft vocabulary"),
        ("corrupt_first", "hs_0.safetensors is corrupt or truncated"),
    ],
)
def test_open_training_data_rejects_bad_data(tmp_path, case, expected):
    path = tmp_path / "data"
    kwargs = {}
    if case == "missing_path":
        arg = tmp_path / "nowhere"
    elif case == "empty_path":
        arg = ""
    elif case == "empty_dir":
        path.mkdir()
        arg = path
    elif case == "no_rows":
        arg = write_data(path, [])
    elif case in ("missing_column", "bad_seq_len"):
        ds = Dataset.from_dict({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]], "seq_len": [4]})
        ds = ds.remove_columns("seq_len") if case == "missing_column" else ds
        ds.save_to_disk(str(path))
        arg = path
    else:
        arg = write_data(path, [5, 6, 7, 8, 9, 10], token_freq=case != "no_vocab_source")
        if case == "missing_hs":
            hs_path(path, 2).unlink()
        elif case == "corrupt_first":
            hs_path(path, 0).write_bytes(b"\x00" * 40)
        kwargs = {
            "hidden_size": {"verifier_hidden_size": 16},
            "aux_layers": {"num_aux_layers": 4},
            "no_vocab_source": {"draft_vocab_size": 16},
        }.get(case, {})
    with pytest.raises(DataError) as err:
        open_training_data(arg, **kwargs)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("garbage", "is corrupt or truncated"),
        ("truncated", "is corrupt or truncated"),
        ("wrong_length", "holds 6 token ids but its dataset row has 7 tokens"),
        ("wrong_tokens", "holds token ids that differ from its dataset row"),
        ("nan", "contains non-finite hidden states"),
        ("inf", "contains non-finite hidden states"),
        ("wrong_hidden_size", "holds hidden_states of shape [7, 4, 9] but [7, 4, 8] is expected"),
    ],
)
def test_bad_hidden_state_file_raises_when_loaded_and_in_validate(tmp_path, case, expected):
    path = write_data(tmp_path / "data", [5, 6, 7, 8])
    good = open_training_data(path)
    good.validate(progress=False)
    bad = hs_path(path, 2)
    tensors = load_file(bad)
    if case == "garbage":
        bad.write_bytes(os.urandom(bad.stat().st_size))
    elif case == "truncated":
        bad.write_bytes(bad.read_bytes()[:-50])
    else:
        if case == "wrong_length":
            tensors = {k: v[:-1].contiguous() for k, v in tensors.items()}
        elif case == "wrong_tokens":
            tensors["token_ids"] = (tensors["token_ids"] + 1) % VOCAB_SYN
        elif case in ("nan", "inf"):
            tensors["hidden_states"][3, 1, 2] = float(case)
        elif case == "wrong_hidden_size":
            tensors["hidden_states"] = torch.randn(7, AUX_SYN + 1, H_SYN + 1)
        save_file(tensors, bad)
    data = open_training_data(path)  # the header of hs_0 is fine: opens
    for load in (
        lambda: data.dataset[2],
        lambda: data.validate(progress=False),
        lambda: PackedBatches(data, 64, seed=0).batch(0, 0),  # one row holds all 4 samples
    ):
        with pytest.raises(DataError) as err:
            load()
        assert str(bad) in str(err.value) and expected in str(err.value), str(err.value)
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Data made by speculators itself
# ---------------------------------------------------------------------------------------------


def test_speculators_prepared_data_loads_without_conversion(target_dir, tmp_path):
    """`speculators prepare-data` (offline: rows in regenerate-responses' format) + hidden
    states as vLLM's hidden-states connector writes them (bf16) load and pack unchanged."""
    from speculators.cli.prepare_data import prepare_data
    from speculators.cli.regenerate_responses import build_boundary_sample

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for k, text in enumerate(["hello", "how are you", "the quick brown fox", "world", "fox"]):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        reply = torch.randint(3, VOCAB, (4 + 3 * k,), generator=gen).tolist() + [2]
        input_ids, loss_mask = build_boundary_sample(list(prompt), reply)
        rows.append({"id": f"c{k}_gen0", "input_ids": input_ids, "loss_mask": loss_mask})
    jsonl = tmp_path / "regenerated.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "prepared"
    prepare_data(
        model=str(target_dir), data=[str(jsonl)], output=str(out), seq_length=4096,
        num_preprocessing_workers=1, skip_token_freq=False,
    )  # fmt: skip
    dataset = load_from_disk(str(out))
    (out / "hidden_states").mkdir()
    for i, row in enumerate(dataset):
        n = len(row["input_ids"])
        hidden = torch.randn(n, 4, HIDDEN, generator=gen).to(torch.bfloat16)
        save_file({"hidden_states": hidden, "token_ids": row["input_ids"]}, hs_path(out, i))

    data = open_training_data(
        out, draft_vocab_size=16, verifier_hidden_size=HIDDEN, num_aux_layers=3
    )  # as the training loop opens it
    assert isinstance(data.dataset, ArrowDataset)
    assert data.settings is None and data.target_layer_ids is None
    data.validate(progress=False)
    d2t, t2d = data.vocab_mapping(16, target_vocab_size=VOCAB)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    ref = build_vocab_mappings_from_distribution(freq, 16, VOCAB)
    assert torch.equal(d2t, ref[0]) and torch.equal(t2d, ref[1])

    # Our packed rows are exactly speculators' own reader + collate over the same samples,
    # shifted as `speculators train` shifts them for peagle (vLLM's drafting alignment).
    reader = ArrowDataset(max_len=64, datapath=out, on_missing="raise")
    collate = CollateFn(64, HIDDEN, num_target_layers=3, dtype=torch.float32,
                        preprocess=shift_batch)  # fmt: skip
    pb = PackedBatches(data, 64, seed=5)
    seen = []
    for step in range(len(pb)):
        samples = pb.step_samples(0, step)
        seen += samples
        ref_batch = collate([reader[i] for i in samples])
        got = pb.batch(0, step)
        for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "position_ids",
                    "document_ids"):  # fmt: skip
            assert torch.equal(got[key], ref_batch[key]), key
        assert torch.equal(got["loss_mask"], ref_batch["loss_mask"].long())
        assert got["hidden_states"].dtype == torch.float32
        # slot t: token t+1 of its sample, aux states at t, the target's last state at t+1
        first = samples[0]
        tokens, states = reader[first]["input_ids"], reader[first]["hidden_states"]
        n = len(tokens) - 1
        assert torch.equal(got["input_ids"][0, :n], tokens[1:])
        assert torch.equal(got["hidden_states"][0, :n], states[:-1].float())
        last = reader[first]["verifier_last_hidden_states"][1:].float()
        assert torch.equal(got["verifier_last_hidden_states"][0, :n], last)
    assert sorted(seen) == list(range(len(dataset)))
