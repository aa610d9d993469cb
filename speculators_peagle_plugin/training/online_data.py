"""A run's online data: where its token ids are (``--data-path``, or the replies
``--prompts`` generates into SAVE/replies), the target's layers its states come from, and
the data opened with the target as their source (the ``online`` section: :mod:`.online`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..common.errors import UserError
from ..common.reading import read_json
from ..data import TrainingData, default_target_layer_ids, open_training_data
from ..data.layout import SETTINGS_FILE
from ..data.prompts import resolved_spec
from ..datagen.build_data import generate_replies
from ..datagen.datagen_config import DataGenConfig
from ..datagen.online_states import CACHE_DIR, CacheSettings, OnlineHiddenStates
from ..model.target import load_target_model
from .distributed import World
from .online import REPLIES_DIR
from .train_config import TrainConfig


def online_data_path(config: TrainConfig) -> Path:
    """``--data-path``, or where ``--prompts`` keeps its replies."""
    if config.online.prompts:
        return Path(config.trainer.checkpoints.save_path) / REPLIES_DIR
    return Path(config.data.data_path)


def online_layer_ids(config: TrainConfig, verifier_config) -> tuple[int, ...]:
    """The aux layers the target's states are taken from: the flag's, else those the token
    data records (``generate-data``'s settings, as offline training defaults to), else
    vLLM's ``(2, N//2, N-3)``; each in ``[0, N]`` (``N``: the state after the last layer)."""
    n = verifier_config.num_hidden_layers
    settings = online_data_path(config) / SETTINGS_FILE
    recorded = read_json(settings).get("target_layer_ids") if settings.is_file() else None
    layer_ids = tuple(config.draft.target_layer_ids or recorded or default_target_layer_ids(n))
    if not all(0 <= i <= n for i in layer_ids):
        raise UserError(
            f"--target-layer-ids must be integers in [0, {n}] for this {n}-layer target, "
            f"got {list(layer_ids)}."
        )
    return layer_ids


def reply_config(config: TrainConfig, layer_ids, device: torch.device) -> DataGenConfig:
    """``generate-data``'s settings for the replies of ``--prompts`` (kept in SAVE/replies)."""
    return DataGenConfig(
        target=config.verifier.verifier_name_or_path, prompts=config.online.prompts,
        output=str(online_data_path(config)), replies=config.online.replies,
        target_layer_ids=tuple(layer_ids), draft_vocab_size=config.draft.draft_vocab_size,
        seed=config.seed, dtype=config.online.target_dtype, device=str(device),
    )


def open_online_data(config: TrainConfig, layer_ids, world: World) -> TrainingData:
    """The run's token data, opened with the target (on this rank's device) as its source of
    hidden states.

    With ``--prompts`` rank 0 first writes the target's replies to SAVE/replies (resumable:
    a rerun finds them complete and generates nothing) while the other ranks wait at a
    barrier (the process group's timeout bounds that wait). Every rank then loads its own
    copy of the target and computes the states of its own rows only.
    """
    data_path, online = online_data_path(config), config.online
    verifier = config.verifier.verifier_name_or_path
    if online.prompts:
        if world.rank == 0:
            generate_replies(reply_config(config, layer_ids, world.device))
        world.barrier()
    model = load_target_model(verifier, getattr(torch, online.target_dtype), world.device)
    # What the disk cache's states depend on; another value empties it (datagen/online_states.py).
    key = {
        "target": str(Path(verifier).resolve()),
        "target_dtype": online.target_dtype,
        "layer_ids": list(layer_ids),
        "data": str(data_path.resolve()),
        "prompts": resolved_spec(online.prompts) if online.prompts else None,
    }
    cache = CacheSettings(
        online.online_cache, online.online_cache_gib * 2**30,
        Path(config.trainer.checkpoints.save_path) / CACHE_DIR, key,
    )
    states = OnlineHiddenStates(model, layer_ids, cache)
    return open_training_data(
        data_path, draft_vocab_size=config.draft.draft_vocab_size, online=states
    )
