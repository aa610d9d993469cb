"""Online training's data: token ids (given, or the target's replies generated first) whose
hidden states the target computes as each batch is read (:mod:`..datagen.online`).

When to choose it (docs/training.md, "Online or offline"): online pays a target forward per
sample per epoch (less with ``--online-cache``) and keeps the target in memory beside the
draft, and writes no hidden states; offline pays their disk once and trains any number of
runs from it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from ..common.reading import read_json
from ..data import TrainingData, default_target_layer_ids, open_training_data
from ..data.layout import SETTINGS_FILE
from ..data.prompts import resolved_spec
from ..datagen.build import generate_replies
from ..datagen.config import DataGenConfig
from ..datagen.online import CACHE_DIR, CacheSettings, OnlineHiddenStates
from ..model.target import load_target_model
from .config import TrainConfig
from .distributed import World

logger = logging.getLogger(__name__)

REPLIES_DIR = "replies"  # under the save path: the token ids --prompts generates


def online_data_path(config: TrainConfig) -> Path:
    """``--data-path``, or where ``--prompts`` keeps its replies."""
    return Path(config.save_path) / REPLIES_DIR if config.prompts else Path(config.data_path)


def online_layer_ids(config: TrainConfig, verifier_config) -> tuple[int, ...]:
    """The aux layers the target's states are taken from: the flag's, else those the token
    data records (``generate-data``'s settings, as offline training defaults to), else
    vLLM's ``(2, N//2, N-3)``; each in ``[0, N]`` (``N``: the state after the last layer)."""
    n = verifier_config.num_hidden_layers
    settings = online_data_path(config) / SETTINGS_FILE
    recorded = read_json(settings).get("target_layer_ids") if settings.is_file() else None
    layer_ids = tuple(config.target_layer_ids or recorded or default_target_layer_ids(n))
    if not all(0 <= i <= n for i in layer_ids):
        raise ValueError(
            f"--target-layer-ids must be integers in [0, {n}] for this {n}-layer target, "
            f"got {list(layer_ids)}."
        )
    return layer_ids


def reply_config(config: TrainConfig, layer_ids, device: torch.device) -> DataGenConfig:
    """``generate-data``'s settings for the replies of ``--prompts`` (kept in SAVE/replies)."""
    return DataGenConfig(
        target=config.verifier_name_or_path, prompts=config.prompts,
        output=str(online_data_path(config)), max_new_tokens=config.max_new_tokens,
        temperature=config.temperature, num_samples=config.num_samples,
        backend=config.generation_backend, target_layer_ids=tuple(layer_ids),
        draft_vocab_size=config.draft_vocab_size, seed=config.seed, dtype=config.target_dtype,
        device=str(device),
    )  # fmt: skip


def open_online_data(config: TrainConfig, layer_ids, world: World) -> TrainingData:
    """The run's token data, opened with the target (on this rank's device) as its source of
    hidden states.

    With ``--prompts`` rank 0 first writes the target's replies to SAVE/replies (resumable:
    a rerun finds them complete and generates nothing) while the other ranks wait at a
    barrier (the process group's timeout bounds that wait). Every rank then loads its own
    copy of the target and computes the states of its own rows only.
    """
    data_path = online_data_path(config)
    if config.prompts:
        if world.rank == 0:
            generate_replies(reply_config(config, layer_ids, world.device))
        world.barrier()
    model = load_target_model(
        config.verifier_name_or_path, getattr(torch, config.target_dtype), world.device
    )
    # What the disk cache's states depend on; another value empties it (datagen/online.py).
    key = {
        "target": str(Path(config.verifier_name_or_path).resolve()),
        "target_dtype": config.target_dtype,
        "layer_ids": list(layer_ids),
        "data": str(data_path.resolve()),
        "prompts": resolved_spec(config.prompts) if config.prompts else None,
    }
    cache = CacheSettings(
        config.online_cache, config.online_cache_gib * 2**30, Path(config.save_path) / CACHE_DIR,
        key,
    )  # fmt: skip
    states = OnlineHiddenStates(model, layer_ids, cache)
    return open_training_data(data_path, draft_vocab_size=config.draft_vocab_size, online=states)


def prepare_cache(data: TrainingData, world: World) -> None:
    """Ready the states cache before the first step: the first rank of each machine empties
    a disk cache made with other settings (the save path may be local to each machine);
    every rank waits for it."""
    cache = data.online.cache
    if cache is None:
        return
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        cache.prepare()
    if world.rank == 0:
        logger.info(
            "online cache (%s): the first %d of %d samples, %.2f GiB",
            type(cache).__name__, cache.rows, data.num_samples, cache.bytes / 2**30,
        )  # fmt: skip
    world.barrier()
