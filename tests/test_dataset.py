"""Reading, validating and packing speculators-format data: synthetic files and every way a
data directory can be bad (data made by speculators itself: tests/test_speculators_data.py).

Oracles: speculators' own readers and writers (ArrowDataset, CollateFn,
build_vocab_mappings_from_distribution, prepare-data), and packed rows rebuilt by hand from
the files.
"""

import json
import math
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset, Features, Sequence, Value, load_from_disk
from safetensors.torch import load_file, save_file
from speculators.train.vocab_mapping import (
    build_vocab_mappings_from_distribution,
    save_token_frequency_distribution,
)

from speculators_peagle_plugin.data import DataError, PackedBatches, open_training_data, pack_rows
from speculators_peagle_plugin.data.layout import SETTINGS_FILE
from speculators_peagle_plugin.training.prefetch import RowsAhead

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
    )
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


def expected_row(path, dataset, samples, seq_len, slots=tuple(range(AUX_SYN))):
    """A packed row rebuilt by hand from the files (the oracle for PackedBatches).

    Each sample is shifted first (speculators' ``shift_batch``): slot t holds token t+1,
    aux states at t (the stored ``slots``), the last state at t+1 and position t+1.
    """
    ids, aux, last, mask, pos, docs, lengths = [], [], [], [], [], [], []
    for doc, i in enumerate(samples):
        n = min(len(dataset[i]["input_ids"]) - 1, seq_len - len(ids))
        hidden = load_file(hs_path(path, i))["hidden_states"].float()
        ids += dataset[i]["input_ids"][1 : n + 1].tolist()
        mask += dataset[i]["loss_mask"][1 : n + 1].tolist()
        aux.append(hidden[:n, list(slots)].flatten(1))
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
        "hidden_states": torch.cat([*aux, torch.zeros(pad, len(slots) * H_SYN)])[None],
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


_LAYERS_135_OF_7 = {"target_layer_ids": [1, 3, 5], "target_num_layers": 7}


@pytest.mark.parametrize(
    ("layer_ids", "slots"),
    [(None, (0, 1, 2)), ((1, 3, 5, 7), (0, 1, 2, 3)), ((3, 7), (1, 3)), ((1, 5), (0, 2))],
)
def test_aux_layers_are_chosen_among_the_recorded_ones_and_the_last_state(
    tmp_path, syn_lengths, layer_ids, slots
):
    """Data of layers (1, 3, 5) on a 7-layer target: a draft may read any of them and layer
    7, the state after the last layer, which every sample stores as its last slot."""
    path = write_data(tmp_path / "data", syn_lengths[:9], seed=len(slots))
    (path / SETTINGS_FILE).write_text(json.dumps(_LAYERS_135_OF_7))
    data = open_training_data(path, aux_layer_ids=layer_ids)
    assert data.num_aux_layers == len(slots)
    assert data.target_layer_ids == (layer_ids or (1, 3, 5))
    dataset = load_from_disk(str(path))
    batches = PackedBatches(data, 40, seed=1)
    for step in range(len(batches)):
        want = expected_row(path, dataset, batches.step_samples(0, step), 40, slots)
        assert_batch_equal(batches.batch(0, step), want)


@pytest.mark.parametrize(
    ("settings", "layer_ids", "sentence"),
    [
        (_LAYERS_135_OF_7, (0, 3), "name layer(s) [0] whose states the data at {path} does not "
         "hold: it holds those of layers [1, 3, 5] and of layer 7 (after the last layer)."),
        (_LAYERS_135_OF_7, (3, 8), "name layer(s) [8] whose states"),
        ({"target_layer_ids": [1, 3, 5]}, (1, 3, 5, 7), "it holds those of layers [1, 3, 5]."),
        (_LAYERS_135_OF_7, (5, 3), "Aux layer ids [5, 3] must be distinct and ascending"),
        (_LAYERS_135_OF_7, (3, 3), "Aux layer ids [3, 3] must be distinct and ascending"),
        (None, (1, 3, 5, 7), "holds 3 aux hidden states per token without recording their "
         "layers, but 4"),
    ],
)
def test_aux_layers_the_data_does_not_hold_are_one_sentence(
    tmp_path, syn_lengths, settings, layer_ids, sentence
):
    path = write_data(tmp_path / "data", syn_lengths[:3])
    if settings is not None:
        (path / SETTINGS_FILE).write_text(json.dumps(settings))
    with pytest.raises(DataError, match=re.escape(sentence.format(path=path))):
        open_training_data(path, aux_layer_ids=layer_ids)


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


class _Spy:
    """PackedBatches with a record of each read (step, thread) and an optional failing step."""

    def __init__(self, batches, fail_at=None):
        self.batches, self.fail_at, self.reads = batches, fail_at, []

    def __len__(self):
        return len(self.batches)

    def batch(self, epoch, index):
        step = epoch * len(self) + index
        self.reads.append((step, threading.current_thread().name))
        if step == self.fail_at:
            raise DataError(f"step {step} cannot be read")
        return self.batches.batch(epoch, index)


@pytest.mark.parametrize(("seed", "start"), [(0, 0), (1, 3), (2, 7)])
@pytest.mark.parametrize("ahead", [True, False])
def test_rows_ahead_gives_each_step_its_row_read_while_the_step_before_trains(
    syn_data, seed, start, ahead
):
    data = open_training_data(syn_data)
    pb = PackedBatches(data, 50, seed=seed)
    dataset = load_from_disk(str(syn_data))
    stop = 2 * len(pb) + len(pb) // 2  # across two epoch boundaries
    spy = _Spy(pb)
    with RowsAhead(spy, stop, ahead=ahead) as rows:
        for step in range(start, stop):
            row, waited = rows.get(step)
            samples = pb.step_samples(*divmod(step, len(pb)))
            assert_batch_equal(row, expected_row(syn_data, dataset, samples, 50))
            assert waited >= 0
    assert [s for s, _ in spy.reads] == list(range(start, stop))  # once each, none past stop
    threads = {name.startswith("rows-ahead") for _, name in spy.reads[1:]}
    assert threads == {ahead} and not spy.reads[0][1].startswith("rows-ahead")
    # a step out of order is read in line; the row read ahead is dropped
    with RowsAhead(pb, stop) as rows:
        rows.get(0)
        assert_batch_equal(rows.get(4)[0], pb.batch(*divmod(4, len(pb))))
    # a row that cannot be read fails the step that needs it, not an earlier one
    failing = _Spy(pb, fail_at=start + 2)
    with RowsAhead(failing, stop, ahead=ahead) as rows:
        rows.get(start)
        rows.get(start + 1)
        with pytest.raises(DataError, match=f"step {start + 2} cannot be read"):
            rows.get(start + 2)


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
