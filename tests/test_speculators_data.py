"""Data made by speculators itself (`speculators prepare-data` + hidden states as vLLM's
connector writes them) loads, validates and packs exactly as speculators' own reader and
collate read it.
"""

import json

import torch
from datasets import load_from_disk
from helpers.chat_target import HIDDEN, VOCAB
from safetensors.torch import save_file
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoTokenizer

from speculators_peagle_plugin.data import PackedBatches, open_training_data
from speculators_peagle_plugin.data.layout import HIDDEN_STATES_DIR, hs_path


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
    )
    dataset = load_from_disk(str(out))
    states = out / HIDDEN_STATES_DIR
    states.mkdir()
    for i, row in enumerate(dataset):
        n = len(row["input_ids"])
        hidden = torch.randn(n, 4, HIDDEN, generator=gen).to(torch.bfloat16)
        save_file({"hidden_states": hidden, "token_ids": row["input_ids"]}, hs_path(states, i))

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
                        preprocess=shift_batch)
    pb = PackedBatches(data, 64, seed=5)
    seen = []
    for step in range(len(pb)):
        samples = pb.step_samples(0, step)
        seen += samples
        ref_batch = collate([reader[i] for i in samples])
        got = pb.batch(0, step)
        for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "position_ids",
                    "document_ids"):
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
