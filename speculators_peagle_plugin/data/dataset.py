"""Reading speculators-format training data: open it and check it.

The layout is described in :mod:`.layout`, the draft vocabulary's mapping in :mod:`.vocab`.
Works unchanged on ``generate-data``'s output and on
data made by ``speculators prepare-data`` with hidden states from vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ..common.reading import read_json
from .layout import HIDDEN_STATES_DIR, SETTINGS_FILE, DataError, aux_slots, hs_path
from .vocab import check_vocab_mapping, vocab_mapping

if TYPE_CHECKING:
    from collections.abc import Sequence


class HiddenStatesSource(Protocol):
    """Where the hidden states come from when they are computed as samples are read (``datagen``'s
    ``OnlineHiddenStates``, ``ServedHiddenStates``): hs_connectors' transfer call, per row.

    ``get_cached(i)`` gives row ``i``'s ``{"hidden_states": [seq, n_aux+1, H],
    "token_ids": [seq]}`` for the layers ``layer_ids``; :meth:`attach` hands it the rows
    (``rows[i]["input_ids"]``) and their lengths once the dataset is open.
    """

    hidden_size: int
    vocab_size: int
    num_aux_layers: int
    layer_ids: tuple[int, ...]

    def attach(self, rows, lengths: list[int]) -> None: ...

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]: ...


def sample_problem(loaded: dict, input_ids: torch.Tensor, shape_tail: tuple[int, int]) -> str:
    """What is wrong with a loaded hidden-state sample, or "" if nothing.

    Our own checks rather than speculators' ``check_hidden_states``: its messages print the
    whole token list, and it does not check the ``[n_aux+1, H]`` tail against the data set.
    """
    if {"hidden_states", "token_ids"} - loaded.keys():
        return f"lacks {sorted({'hidden_states', 'token_ids'} - loaded.keys())}"
    hidden, tokens = loaded["hidden_states"], loaded["token_ids"]
    n = input_ids.shape[0]
    if tokens.dim() != 1 or tokens.shape[0] != n:
        return f"holds {tokens.numel()} token ids but its dataset row has {n} tokens"
    if not torch.equal(tokens.long(), input_ids.long()):
        return "holds token ids that differ from its dataset row"
    if tuple(hidden.shape) != (n, *shape_tail):
        return (
            f"holds hidden_states of shape {list(hidden.shape)} but {[n, *shape_tail]} is expected"
        )
    # min/max propagate NaN and expose inf, without the full-size bool tensor of isfinite().
    if not bool(torch.isfinite(torch.stack(torch.aminmax(hidden))).all()):
        return "contains non-finite hidden states (NaN or inf)"
    return ""


def _checked_arrow_dataset_class():
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    class CheckedArrowDataset(ArrowDataset):
        """speculators' ``ArrowDataset`` (on_missing="raise") whose bad files raise DataError.

        Upstream turns a token mismatch into a skipped sample with a warning and lets a corrupt
        file raise safetensors' own error; training must stop instead, naming the file.
        """

        shape_tail: tuple[int, int]
        aux_slots: list[int]  # the stored slots a sample's "hidden_states" concatenates

        def _get_raw_data(self, index: int) -> dict:
            file_idx = self._map_to_file_idx(index)
            hs_dir = getattr(self.transfer, "hidden_states_path", None)
            if hs_dir is None:  # online: the target computes them (datagen/online_states.py)
                loaded = self.transfer.get_cached(file_idx)
                what = f"The target's hidden-state sample of row {file_idx}"
            else:
                path = hs_path(hs_dir, file_idx)
                what = f"Hidden-state file {path}"
                try:
                    loaded = self.transfer.get_cached(file_idx)
                except Exception as err:  # noqa: BLE001 - safetensors raises its own errors
                    raise DataError(f"{what} is corrupt or truncated ({err}).") from err
                if loaded is None:
                    raise DataError(f"{what} is missing.")
            if isinstance(loaded, SampleUnavailable):  # a server gave none (on_missing)
                return loaded
            row = self.data[index]
            problem = sample_problem(loaded, row["input_ids"], self.shape_tail)
            if problem:
                raise DataError(f"{what} {problem}.")
            hidden = loaded["hidden_states"]
            return {
                "hidden_states": hidden[:, self.aux_slots].flatten(1),  # [seq, n_aux * H]
                "input_ids": row["input_ids"],  # [seq]
                "verifier_last_hidden_states": hidden[:, -1],  # [seq, H]
                "loss_mask": row["loss_mask"],  # [seq]
            }

    return CheckedArrowDataset


@dataclass
class TrainingData:
    """An opened, checked speculators data directory.

    Attributes:
        path: the directory.
        dataset: speculators' ``ArrowDataset`` (a checked subclass); ``dataset[i]`` is the
            sample dict speculators' ``CollateFn`` packs; a bad file raises :class:`DataError`.
        hidden_size: target hidden size ``H``.
        num_aux_layers: aux layers per token a sample gives (the files hold their own
            ``n_aux + 1`` slots; see ``aux_layer_ids``).
        num_samples: dataset rows.
        num_loss_tokens: supervised tokens over all rows.
        lengths: ``seq_len`` of each row.
        settings: generate-data's settings, or None for data made by speculators itself.
        online: where the hidden states come from when the target computes them during
            training (None: the files in ``hidden_states/``).
        aux_layer_ids: the aux layers a sample gives when chosen at opening (None: the
            stored ones).
    """

    path: Path
    dataset: object
    hidden_size: int
    num_aux_layers: int
    num_samples: int
    num_loss_tokens: int
    lengths: list[int]
    settings: dict | None
    online: HiddenStatesSource | None = None
    aux_layer_ids: tuple[int, ...] | None = None

    @property
    def hidden_states_dir(self) -> Path:
        return self.path / HIDDEN_STATES_DIR

    @property
    def target_layer_ids(self) -> tuple[int, ...] | None:
        """The aux layer ids a sample gives: those chosen at opening, else those the data
        was generated with (None if unrecorded)."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return None if self.settings is None else tuple(self.settings["target_layer_ids"])

    def validate(self, progress: bool = True) -> None:
        """Load and check every hidden-state file; the first bad one raises DataError.

        Online data has no files: its states are checked as the target computes them.
        """
        from tqdm import tqdm

        if self.online is not None:
            return
        for i in tqdm(
            range(self.num_samples), desc="Checking data", unit="sample", disable=not progress
        ):
            self.dataset[i]

    def check_vocab_mapping(self, draft_vocab_size: int) -> None:
        """Raise DataError unless :meth:`vocab_mapping` can give this size (builds nothing)."""
        check_vocab_mapping(self.path, draft_vocab_size)

    def vocab_mapping(
        self, draft_vocab_size: int, target_vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d2t, t2d)`` for a draft vocabulary of ``draft_vocab_size`` tokens
        (:func:`~.vocab.vocab_mapping`); ``target_vocab_size`` defaults to the one the
        data records."""
        if target_vocab_size is None and self.settings is not None:
            target_vocab_size = self.settings["target_vocab_size"]
        return vocab_mapping(self.path, draft_vocab_size, target_vocab_size)


def _hidden_states_shape(path: Path) -> list[int]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_slice("hidden_states").get_shape()
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise DataError(f"Hidden-state file {path} is corrupt or truncated ({err}).") from err


def _read_rows(path: Path) -> tuple[int, np.ndarray, int, int]:
    """``(rows, seq_len per row, supervised tokens, largest token id)`` of the Arrow dataset
    at ``path``, whose columns must be present and agree row by row."""
    import pyarrow.compute as pc
    from datasets import load_from_disk

    try:
        raw = load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(
            f"Data path {path} holds no dataset saved with save_to_disk (make one with "
            "`speculators-peagle generate-data` or `speculators prepare-data`)."
        ) from err
    except Exception as err:  # noqa: BLE001 - datasets fails on a 0-shard (empty) dataset
        state = read_json(path / "state.json")
        if not state.get("_data_files"):
            raise DataError(f"The dataset at {path} is empty.") from err
        raise DataError(f"The dataset at {path} is unreadable ({err}).") from err
    missing = {"input_ids", "loss_mask", "seq_len"} - set(raw.column_names)
    if missing:
        raise DataError(f"The dataset at {path} lacks the column(s) {sorted(missing)}.")
    if len(raw) == 0:
        raise DataError(f"The dataset at {path} is empty.")
    table = raw.with_format("arrow")[:]
    n_ids = pc.list_value_length(table["input_ids"]).to_numpy()
    n_mask = pc.list_value_length(table["loss_mask"]).to_numpy()
    lengths = table["seq_len"].to_numpy()
    bad = np.flatnonzero((n_ids != n_mask) | (n_ids != lengths))
    if len(bad):
        i = int(bad[0])
        raise DataError(
            f"Row {i} of the dataset at {path} has {n_ids[i]} input_ids, {n_mask[i]} loss_mask "
            f"entries and seq_len {lengths[i]}; they must agree."
        )
    num_loss_tokens = int(pc.sum(pc.list_flatten(table["loss_mask"])).as_py() or 0)
    largest = int(pc.max(pc.list_flatten(table["input_ids"])).as_py() or 0)
    return len(raw), lengths, num_loss_tokens, largest


def _hidden_states_layout(
    path: Path, num_rows: int, verifier_hidden_size: int | None, num_aux_layers: int | None
) -> tuple[int, int]:
    """``(H, n_aux)`` read from ``hs_0``'s header, once every row's file is known to exist."""
    hs_dir = path / HIDDEN_STATES_DIR
    present = set(os.listdir(hs_dir)) if hs_dir.is_dir() else set()
    absent = [i for i in range(num_rows) if hs_path(hs_dir, i).name not in present]
    if len(absent) == num_rows:
        raise DataError(
            f"{path} holds token ids but no hidden states ({hs_dir} has none of its "
            f"{num_rows} rows); train with --online to compute them during training, or make "
            "them with generate-data."
        )
    if absent:
        raise DataError(
            f"{hs_dir} lacks the hidden states of {len(absent)} of {num_rows} rows (first: "
            f"{hs_path(hs_dir, absent[0]).name}); run generate-data again to complete it."
        )
    shape = _hidden_states_shape(hs_path(hs_dir, 0))
    if len(shape) != 3 or shape[1] < 2:
        raise DataError(
            f"Hidden-state file {hs_path(hs_dir, 0)} holds hidden_states of shape {shape}, not "
            "[seq, n_aux + 1, hidden_size]."
        )
    hidden_size, n_aux = shape[2], shape[1] - 1
    if verifier_hidden_size is not None and verifier_hidden_size != hidden_size:
        raise DataError(
            f"The data at {path} holds hidden states of size {hidden_size} "
            f"({hs_path(hs_dir, 0).name}) but the verifier's hidden size is "
            f"{verifier_hidden_size}; generate the data with this verifier."
        )
    if num_aux_layers is not None and num_aux_layers != n_aux:
        raise DataError(
            f"The data at {path} holds {n_aux} aux hidden states per token "
            f"({hs_path(hs_dir, 0).name}) but {num_aux_layers} target layer ids are configured."
        )
    return hidden_size, n_aux


def _stored_states(path: Path, num_rows: int, verifier_hidden_size, num_aux_layers):
    """``(H, n_aux, reader)`` of the hidden-state files, their layout checked."""
    hidden_size, n_aux = _hidden_states_layout(path, num_rows, verifier_hidden_size, num_aux_layers)
    from hs_connectors.transfer import FP8Transfer

    # FP8Transfer reads plain files unchanged and dequantizes vLLM's FP8-connector files.
    return hidden_size, n_aux, FP8Transfer(path / HIDDEN_STATES_DIR, dequantize_dtype=torch.float32)


def _check_online_ids(path: Path, largest_id: int, online: HiddenStatesSource) -> None:
    """Every token id of the rows is in the vocabulary of the target that computes their
    states."""
    if largest_id >= online.vocab_size:
        raise DataError(
            f"The dataset at {path} holds token id {largest_id}, outside the target's "
            f"vocabulary of {online.vocab_size}; it was made for another target."
        )


def _generation_settings(path: Path) -> dict | None:
    """generate-data's record of how it made ``path`` (its layer ids among them), if any."""
    settings_path = path / SETTINGS_FILE
    return read_json(settings_path) if settings_path.exists() else None


def _chosen_aux_slots(
    chosen: tuple[int, ...] | None,
    online: HiddenStatesSource | None,
    settings: dict | None,
    n_aux: int,
    path: Path,
) -> list[int]:
    """The stored slots that give the ``chosen`` aux layers (:func:`~.layout.aux_slots`):
    every slot when none are chosen; else by the layer ids ``online`` computes, else by those
    generate-data's ``settings`` record, else by their count alone."""
    if chosen is None:
        return list(range(n_aux))
    if online is not None:  # computed for its own layer ids (N among them, if asked)
        return aux_slots(chosen, online.layer_ids, None, n_aux, path)
    if settings is not None:
        recorded, last = settings["target_layer_ids"], settings.get("target_num_layers")
        return aux_slots(chosen, recorded, last, n_aux, path)
    return aux_slots(chosen, None, None, n_aux, path)


def _open_dataset(path: Path, lengths: np.ndarray, transfer, online: HiddenStatesSource | None,
                  shape_tail: tuple[int, int]):
    """The checked arrow dataset over ``path``'s rows, its hidden states read through
    ``transfer`` (the stored files, or ``online``, attached to the rows); every sample's
    states are ``shape_tail = (aux slots + 1, hidden size)``."""
    dataset = _checked_arrow_dataset_class()(
        max_len=int(lengths.max()), datapath=str(path), transfer=transfer, on_missing="raise"
    )
    if online is not None:
        online.attach(dataset.data, [int(x) for x in lengths])
    dataset.shape_tail = shape_tail
    return dataset


def open_training_data(
    data_path: str | os.PathLike,
    *,
    draft_vocab_size: int | None = None,
    verifier_hidden_size: int | None = None,
    num_aux_layers: int | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    online: HiddenStatesSource | None = None,
) -> TrainingData:
    """Open a speculators data directory for training, checking what can be checked cheaply.

    Works unchanged on data from ``speculators prepare-data`` + vLLM hidden states and on
    ``generate-data``'s output. Checks: the dataset exists and is non-empty with consistent
    columns, every row has its ``hs_<i>.safetensors``, the files' hidden size and aux-layer count
    match ``verifier_hidden_size`` / ``num_aux_layers``, and a ``draft_vocab_size`` mapping is
    available. Contents of each file are checked when it is loaded (or by ``validate()``).

    ``aux_layer_ids`` chooses the aux layers each sample gives, in order: any the data
    records, and the target's layer count ``N`` (the state after its last layer, stored as
    every sample's last slot; see :func:`~.layout.aux_slots`). Data that records no layer ids gives
    its stored ones, whose count must match.

    With ``online`` (a :class:`HiddenStatesSource`) the hidden states come from the
    target as each sample is read, and the directory needs only the token ids (its
    ``hidden_states/``, if any, is not read); every token id must be in the target's
    vocabulary.

    Raises:
        DataError: one sentence naming the path, file or setting that is wrong.
    """
    path = Path(data_path)
    if not str(data_path) or not path.is_dir():
        raise DataError(f"Data path {str(data_path)!r} is not an existing directory.")
    num_rows, lengths, num_loss_tokens, largest_id = _read_rows(path)
    if online is None:
        hidden_size, n_aux, transfer = _stored_states(
            path, num_rows, verifier_hidden_size, num_aux_layers
        )
    else:
        _check_online_ids(path, largest_id, online)
        hidden_size, n_aux, transfer = online.hidden_size, online.num_aux_layers, online
    dataset = _open_dataset(path, lengths, transfer, online, (n_aux + 1, hidden_size))
    settings = _generation_settings(path)
    chosen = None if aux_layer_ids is None else tuple(int(i) for i in aux_layer_ids)
    dataset.aux_slots = _chosen_aux_slots(chosen, online, settings, n_aux, path)
    data = TrainingData(
        path=path,
        dataset=dataset,
        hidden_size=hidden_size,
        num_aux_layers=len(dataset.aux_slots),
        num_samples=num_rows,
        num_loss_tokens=num_loss_tokens,
        lengths=[int(x) for x in lengths],
        settings=settings,
        online=online,
        aux_layer_ids=chosen,
    )
    if draft_vocab_size is not None:
        data.check_vocab_mapping(draft_vocab_size)
    return data
