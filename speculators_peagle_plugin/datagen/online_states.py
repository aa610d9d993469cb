"""Online hidden states: the target computes a sample's states when a batch asks for them.

Legend: ``seq`` = tokens of one sample, ``H`` = target hidden size, ``n_aux`` = aux layers.

Offline training reads ``hs_<i>.safetensors`` through hs_connectors' file transfer;
online training swaps in :class:`OnlineHiddenStates` (a
:class:`~..data.dataset.HiddenStatesSource`), which answers the same call
(``get_cached(i)`` -> ``{"hidden_states": [seq, n_aux+1, H], "token_ids": [seq]}``) by
running the target on dataset row ``i``. Everything downstream — the checked dataset,
``shift_batch``, packing, the collate — is the offline code unchanged, so the two paths
differ only in where a sample's states come from.

The states are :func:`~.capture.capture_hidden_states` of one sample, the function
``generate-data``'s transformers pass writes to disk: the same aux layers, the final
residual stream taken before the norm, the target's dtype. Each document of a packed row
is its own forward, so no document attends to another, and a row's states are those the
offline files hold (bit for bit where the offline pass ran the sample alone as well). One
forward over the whole packed row, with a block-diagonal mask and positions restarting per
document, would use a GPU better on many short documents, but it rounds differently from
the offline pass (other matmul shapes) and needs an attention backend that honours such a
mask; a forward per document is exact and works for any transformers target.

A batch is a pure function of ``(epoch, step)`` as long as a sample's states are a pure
function of the sample; the caches below keep it so (see :class:`StatesCache`).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.files import atomic_write, atomic_write_json, remove_stale_temporaries
from ..common.reading import read_json
from ..data.layout import hs_path
from .capture import capture_hidden_states, save_safetensors

logger = logging.getLogger(__name__)

CACHE_KINDS = ("none", "ram", "disk")
CACHE_DIR = "online-cache"  # under the save path: the disk cache
CACHE_KEY_FILE = "cache.json"  # what the disk cache's states were computed with
DISK_CACHE_DTYPE = torch.bfloat16
TOKEN_ID_BYTES = 8


class StatesCache:
    """A bounded store of samples' hidden states, reused across epochs.

    What it holds is fixed up front: the dataset's first rows, in index order, as many as
    fit under ``capacity_bytes`` (fill-until-full over a static order). LRU would buy
    nothing here: every epoch visits every sample once in a fresh random order, so any
    subset of the right size gets the same hit rate, and a static subset never evicts,
    never rewrites, and is the same on every rank and after every resume.

    A sample's states are then a pure function of the sample, cached or not: the RAM cache
    stores them exactly as computed, and the disk cache serves a sample it holds in
    bfloat16 in EVERY epoch, including the one that computes it (the computed states are
    rounded before use). Resuming, or a file that went missing, therefore never changes
    what a step sees.

    Args:
        lengths: ``seq`` of every dataset row.
        bytes_per_token: what one token costs this cache.
        capacity_bytes: the cap.
    """

    def __init__(self, lengths: list[int], bytes_per_token: int, capacity_bytes: float):
        used, rows = 0, 0
        for n in lengths:
            if used + n * bytes_per_token > capacity_bytes:
                break
            used, rows = used + n * bytes_per_token, rows + 1
        self.rows, self.bytes = rows, used  # rows [0, rows) are cached, taking ``bytes``
        self.hits = 0

    def prepare(self) -> None:
        """Ready the store before the first read (one process calls it)."""

    def holds(self, index: int) -> bool:
        return index < self.rows

    def get(self, index: int, token_ids: torch.Tensor) -> torch.Tensor | None:
        """The stored ``[seq, n_aux+1, H]`` states of row ``index``, or None."""
        raise NotImplementedError

    def put(self, index: int, token_ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Store freshly computed states of a held row; returns the states to train on."""
        raise NotImplementedError


class RamCache(StatesCache):
    """States in host memory, exactly as computed (the cap counts their own dtype)."""

    def __init__(self, lengths, slots: int, hidden_size: int, dtype, capacity_bytes):
        super().__init__(lengths, slots * hidden_size * dtype.itemsize, capacity_bytes)
        self.store: dict[int, torch.Tensor] = {}

    def get(self, index, token_ids):
        states = self.store.get(index)
        self.hits += states is not None
        return states

    def put(self, index, token_ids, states):
        self.store[index] = states.cpu()
        return states


class DiskCache(StatesCache):
    """States as ``DIR/hs_<i>.safetensors`` in bfloat16 (speculators' file layout).

    Written under a temporary name and renamed, so a file is complete or absent; one that
    does not load or holds other tokens is recomputed and rewritten. ``DIR/cache.json``
    records what the states were computed with (``key``); files made with another key are
    removed by :meth:`prepare`. The cap counts the states and token ids, not the headers.
    """

    def __init__(self, directory: Path, key: dict, lengths, slots: int, hidden_size: int,
                 capacity_bytes):
        per_token = slots * hidden_size * DISK_CACHE_DTYPE.itemsize + TOKEN_ID_BYTES
        super().__init__(lengths, per_token, capacity_bytes)
        self.directory, self.key = Path(directory), key

    def prepare(self) -> None:
        """Empty the directory if its states were computed otherwise (one process calls this
        before any reads)."""
        key_file = self.directory / CACHE_KEY_FILE
        if self.directory.exists():
            old = read_json(key_file) if key_file.exists() else None
            if old != self.key:
                logger.info("%s holds states of other settings; emptying it", self.directory)
                shutil.rmtree(self.directory, ignore_errors=True)  # (another machine's too)
            else:
                remove_stale_temporaries(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(key_file, self.key)

    def get(self, index, token_ids):
        from safetensors.torch import load_file

        path = hs_path(self.directory, index)
        if not path.exists():
            return None
        try:
            loaded = load_file(str(path))
        except Exception:  # noqa: BLE001 - safetensors raises its own error types
            return None
        if not torch.equal(loaded.get("token_ids", torch.empty(0)), token_ids):
            return None
        self.hits += 1
        return loaded["hidden_states"]

    def put(self, index, token_ids, states):
        rounded = states.to(DISK_CACHE_DTYPE)
        tensors = {"hidden_states": rounded.cpu().contiguous(), "token_ids": token_ids.cpu()}
        atomic_write(hs_path(self.directory, index), lambda tmp: save_safetensors(tensors, tmp))
        return rounded


@dataclass(frozen=True)
class CacheSettings:
    """Which :class:`StatesCache` to build: ``kind`` in :data:`CACHE_KINDS`, its cap, and for
    ``disk`` its directory and the key of what its states depend on."""

    kind: str = "none"
    capacity_bytes: float = 0
    directory: Path | None = None
    key: dict | None = None

    def build(self, lengths, slots: int, hidden_size: int, dtype) -> StatesCache | None:
        if self.kind == "ram":
            return RamCache(lengths, slots, hidden_size, dtype, self.capacity_bytes)
        if self.kind == "disk":
            return DiskCache(
                self.directory, self.key, lengths, slots, hidden_size, self.capacity_bytes
            )
        return None


class OnlineHiddenStates:
    """hs_connectors' ``HiddenStatesTransfer`` call, answered by running the target.

    ``get_cached(i)`` returns row ``i``'s ``{"hidden_states": [seq, n_aux+1, H] (target
    dtype, on the target's device), "token_ids": [seq]}``, from ``cache`` when it holds
    them, else from one target forward over the row alone.

    Args:
        model: the target (:func:`~..model.target.load_target_model`).
        layer_ids: aux layer ids (the residual stream after that many decoder layers).
        cache: which :class:`StatesCache` to build over the rows (:meth:`attach`).

    ``seconds`` accumulates the time spent in target forwards (the loop reads and resets
    it per step); ``computed`` counts them.
    """

    def __init__(self, model: torch.nn.Module, layer_ids, cache=CacheSettings()):
        text_config = model.config.get_text_config()
        self.model, self.layer_ids = model, tuple(layer_ids)
        self.hidden_size = text_config.hidden_size
        self.vocab_size = text_config.vocab_size
        self.num_aux_layers = len(self.layer_ids)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache_settings = cache
        self.cache: StatesCache | None = None
        self.rows = None
        self.seconds, self.computed = 0.0, 0

    def attach(self, rows, lengths: list[int]) -> None:
        """Give it the dataset rows it answers for (``rows[i]["input_ids"]``) and build the
        cache over their ``lengths``."""
        self.rows = rows
        slots = self.num_aux_layers + 1
        self.cache = self.cache_settings.build(lengths, slots, self.hidden_size, self.dtype)

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        token_ids = torch.as_tensor(self.rows[file_idx]["input_ids"]).long()
        cache = self.cache if self.cache is not None and self.cache.holds(file_idx) else None
        states = None if cache is None else cache.get(file_idx, token_ids)
        if states is None:
            states = self._compute(token_ids)
            if cache is not None:
                states = cache.put(file_idx, token_ids, states)
        return {"hidden_states": states.to(self.device, self.dtype), "token_ids": token_ids}

    def get_generated(self, hs_transfer_params):
        raise NotImplementedError("online hidden states are computed, never requested")

    def _compute(self, token_ids: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        states = capture_hidden_states(self.model, token_ids.to(self.device), self.layer_ids)
        if states.is_cuda:
            torch.cuda.synchronize(states.device)  # time the forward, not its launch
        self.seconds += time.perf_counter() - began
        self.computed += 1
        return states

    def take_seconds(self) -> float:
        """Seconds in target forwards since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
