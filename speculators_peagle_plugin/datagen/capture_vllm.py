"""Hidden states from vLLM: recorded by the replies' engine as it generates
(:mod:`.vllm_recorder`, placed here), or a prefill of each dataset row through vLLM's
``extract_hidden_states`` speculative method, written by :mod:`.vllm_connector`.

vLLM's aux layer id ``L`` is the residual stream after ``L`` decoder layers (the sum its
decoder layers carry as ``hidden_states + residual``), transformers' ``hidden_states[L]``;
id ``N`` (the layer count) is the final residual stream before the final norm. So asking
for ``(*layer_ids, N)`` gives exactly the ``[seq, n_aux+1, H]`` of :mod:`.capture`.

The connector names a file after its request; the files are matched back to dataset rows
by their token ids (identical rows get identical states) and renamed to ``hs_<i>``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..common.files import atomic_write
from ..data.layout import HIDDEN_STATES_DIR, hs_path
from ..data.storage import STORAGE_DTYPE_KEY, stored_tensors
from ..engine.vllm_client import VllmJob, VllmWorker
from .capture import log_capture, pending_rows, save_safetensors
from .datagen_config import VLLM_BATCHES_PER_SHARD, DataGenConfig
from .vllm_recorder import FIRST_COMPUTED_KEY

logger = logging.getLogger(__name__)

STAGING_DIR = ".vllm-capture"  # under hidden_states/: the connector's files before renaming
RECORDED_DIR = ".generation"  # under hidden_states/: the replies' engine's recorded states
CAPTURE_LOG_FILE = "vllm-capture.log"
# the KV connector's module, loaded by vLLM in its worker (never here: it imports vLLM)
VLLM_CONNECTOR = f"{__package__}.vllm_connector"


def extract_hidden_states_config(layer_ids, num_layers: int) -> dict:
    """vLLM's ``speculative_config`` that captures aux layers ``layer_ids`` and the last
    layer ``num_layers`` of every prompt token."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,  # the method's only value; it drafts nothing
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": [*layer_ids, num_layers]}
        },
    }


def capture_engine_overrides(
    config: DataGenConfig, layer_ids: tuple[int, ...], num_layers: int, staging: Path
) -> dict:
    """``LLM(...)`` arguments of an engine that writes each request's prompt states."""
    return {
        "tensor_parallel_size": config.tensor_parallel_size,
        "speculative_config": extract_hidden_states_config(layer_ids, num_layers),
        "kv_transfer_config": {
            "kv_connector": "HiddenStatesFileConnector",
            "kv_connector_module_path": VLLM_CONNECTOR,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": str(staging),
                # The connector writes synchronously and renames complete files: no lock.
                "use_synchronization_lock": False,
                STORAGE_DTYPE_KEY: config.storage_dtype,
            },
        },
    }


def _token_ids(path: Path) -> tuple[int, ...]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return tuple(fh.get_tensor("token_ids").tolist())


def _rows_by_token_ids(rows: Iterable[tuple[int, Sequence[int]]]) -> dict[tuple, list[int]]:
    """``{token ids: [row indexes]}`` (identical rows share one file's states)."""
    wanted: dict[tuple, list[int]] = {}
    for i, ids in rows:
        wanted.setdefault(tuple(ids), []).append(i)
    return wanted


def _place(staging: Path, hs_dir: Path, rows: dict[int, list[int]]) -> None:
    """Rename the connector's files to ``hs_<i>`` of the rows with their token ids."""
    wanted = _rows_by_token_ids(rows.items())
    for path in staging.glob("*.safetensors"):
        indexes = wanted.pop(_token_ids(path), None)
        if indexes is None:
            continue
        for i in indexes[1:]:
            atomic_write(hs_path(hs_dir, i), lambda tmp, p=path: shutil.copyfile(p, tmp))
        os.replace(path, hs_path(hs_dir, indexes[0]))
    if wanted:
        missing = sorted(i for indexes in wanted.values() for i in indexes)
        raise RuntimeError(f"vLLM wrote no hidden states for dataset rows {missing[:10]}.")


def _advance(bar, before: int):
    """The worker's progress events move ``bar`` per finished request of a shard."""

    def on_event(message: dict) -> None:
        if message["event"] == "progress":
            bar.update(before + message["done"] - bar.n)

    return on_event


def write_hidden_states_vllm(
    config: DataGenConfig, output: Path, layer_ids: tuple[int, ...], settings: dict
) -> int:
    """Hidden states of each row of ``output`` without a valid ``hs_<i>.safetensors``, from
    a vLLM engine in a child process. Resumable per shard of rows.

    Raises ``RuntimeError`` when vLLM cannot run the capture (the caller falls back).
    Returns the number of files written.
    """
    from tqdm import tqdm

    shape_tail = (len(layer_ids) + 1, settings["target_hidden_size"])
    dataset, hs_dir, todo = pending_rows(output, shape_tail)
    if not todo:
        return 0
    staging = hs_dir / STAGING_DIR
    shutil.rmtree(staging, ignore_errors=True)
    overrides = capture_engine_overrides(
        config, layer_ids, settings["target_num_layers"], staging.absolute()
    )
    shard = config.replies.batch_size * VLLM_BATCHES_PER_SHARD
    start, tokens = time.perf_counter(), 0
    with (
        VllmWorker(
            output / CAPTURE_LOG_FILE, in_process=config.tensor_parallel_size == 1,
            kv_cache_gb=config.engine.kv_cache_gb,
        ) as worker,
        tqdm(
            total=len(dataset), initial=len(dataset) - len(todo), unit="sample",
            desc="Hidden states (vLLM)",
        ) as bar,
    ):
        for b in range(0, len(todo), shard):
            rows = {i: dataset[i]["input_ids"] for i in todo[b : b + shard]}
            job = VllmJob(
                target=str(Path(config.target).resolve()), prompts=list(rows.values()),
                max_tokens=1, batch_size=config.replies.batch_size, dtype=config.dtype,
                seed=config.seed, engine_overrides=overrides,
            )
            before = bar.n
            worker.run(job, on_event=_advance(bar, before))
            _place(staging, hs_dir, rows)
            shutil.rmtree(staging, ignore_errors=True)
            tokens += sum(map(len, rows.values()))
            bar.update(before + len(rows) - bar.n)
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    log_capture(len(todo), tokens, start, "vLLM")
    return len(todo)


def recording_spec(output: Path, layer_ids: tuple[int, ...], num_layers: int) -> dict:
    """What the replies' engine records (:class:`~.vllm_recorder.HiddenStatesRecorder`):
    the aux layers and the final residual stream (id ``num_layers``) of every row."""
    staging = (output / HIDDEN_STATES_DIR / RECORDED_DIR).absolute()
    return {"dir": str(staging), "layer_ids": [*layer_ids, num_layers]}


def _prefix_keys(ids: list[int], lengths: list[int]) -> dict[int, int]:
    """``{k: hash of ids[:k]}`` for each k of the ascending ``lengths`` up to ``len(ids)``,
    chained, so one pass over ``ids`` (a match is confirmed on the ids themselves)."""
    keys, key, start = {}, 0, 0
    for k in lengths:
        if k > len(ids):
            break
        key, start = hash((key, tuple(ids[start:k]))), k
        keys[k] = key
    return keys


def place_recorded(config: DataGenConfig, output: Path, shape_tail: tuple[int, int]) -> int:
    """Write ``hs_<i>`` of every row still without states whose tokens the replies' engine
    recorded, in ``config``'s storage format. Returns the number of rows written.

    A recording holds every token of a row but the last, which the engine sampled and never
    fed back: its slot gets zeros, which nothing reads, since the row has no loss on that
    token (the slot would hold the target's distribution after the reply). A recording whose
    prompt began with a prefix vLLM had cached gets that prefix's states from a recording that
    computed them: recordings go in the order of their first computed position, so the one
    that computed a prefix (which starts earlier) is complete before any that borrows it.
    A recording is matched to rows by its token ids, like the connector's files.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    staging = output / HIDDEN_STATES_DIR / RECORDED_DIR
    if not staging.is_dir():
        return 0
    dataset, hs_dir, todo = pending_rows(output, shape_tail)
    wanted = _rows_by_token_ids((i, dataset[i]["input_ids"][:-1]) for i in todo)
    heads = []  # (first computed position, file, token ids)
    for path in staging.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as fh:
            first = int(fh.get_tensor(FIRST_COMPUTED_KEY)[0])
            heads.append((first, path, fh.get_tensor("token_ids").tolist()))
    lengths = sorted({first for first, _, _ in heads if first})
    keys = {path: _prefix_keys(ids, lengths) for _, path, ids in heads}
    borrowed = {(first, keys[path][first]) for first, path, _ in heads if first}
    # (length, key) -> (the prefix's token ids, its states [length, n, H])
    prefixes: dict[tuple[int, int], tuple[list[int], torch.Tensor]] = {}
    placed = 0
    for first, path, ids in sorted(heads, key=lambda head: (head[0], head[1].name)):
        states = load_file(path)["hidden_states"]
        if first:
            source = prefixes.get((first, keys[path][first]))
            if source is None or source[0] != ids[:first]:
                continue  # no recording computed this prefix: left to a capture pass
            states[:first] = source[1]
        for k, key in keys[path].items():
            if (k, key) in borrowed and (k, key) not in prefixes:
                prefixes[(k, key)] = (ids[:k], states[:k].clone())
        for i in wanted.pop(tuple(ids), []):
            states_row = torch.cat([states, states.new_zeros((1, *states.shape[1:]))])
            ids_row = torch.tensor(dataset[i]["input_ids"], dtype=torch.long)
            tensors = stored_tensors(states_row, ids_row, config.storage_dtype)
            atomic_write(hs_path(hs_dir, i), lambda tmp, t=tensors: save_safetensors(t, tmp))
            placed += 1
        path.unlink()  # the disk holds each row once: its recording or its file
    shutil.rmtree(staging)
    logger.info(
        "The replies' engine recorded the hidden states of %d of %d rows; %d left to a "
        "capture pass.", placed, len(todo), len(todo) - placed,
    )
    return placed
