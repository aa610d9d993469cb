"""Online training's data: token ids (given, or the target's replies generated first) whose
hidden states the target computes as each batch is read (:mod:`..datagen.online_states`).

When to choose it (docs/training.md, "Online or offline"): online pays a target forward per
sample per epoch (less with ``--online-cache``) and keeps the target in memory beside the
draft, and writes no hidden states; offline pays their disk once and trains any number of
runs from it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..common.dtypes import DTYPE_NAMES
from ..common.errors import UserError
from ..common.reading import read_json
from ..common.settings import check_choices, fail, section, setting
from ..data import TrainingData, default_target_layer_ids, open_training_data
from ..data.layout import SETTINGS_FILE
from ..data.prompts import prompt_source_exists, resolved_spec
from ..datagen.build_data import generate_replies
from ..datagen.datagen_config import DataGenConfig, ReplyConfig
from ..datagen.online_states import CACHE_DIR, CACHE_KINDS, CacheSettings, OnlineHiddenStates
from ..model.target import load_target_model
from .distributed import World

if TYPE_CHECKING:
    from .train_config import TrainConfig

logger = logging.getLogger(__name__)

REPLIES_DIR = "replies"  # under the save path: the token ids --prompts generates


@dataclass(frozen=True)
class OnlineConfig:
    """The ``online`` section: the target computes the hidden states as training reads rows,
    of given token ids or of its own replies to ``prompts`` (the ``replies`` section)."""

    online: bool = setting(
        False,
        "Compute the target's hidden states during training: every rank runs the target on "
        "its own rows; no hidden states are read or written (see --online-cache).",
    )
    prompts: str | None = setting(
        None,
        "With --online, instead of --data-path: a prompt set as generate-data --prompts takes "
        "it; the target's replies are generated first into SAVE/replies (a rerun reuses them).",
    )
    target_dtype: str = setting(
        "float32",
        "With --online: the target's dtype (generate-data's --dtype), also its states'.",
        choices=DTYPE_NAMES,
    )
    online_cache: str = setting(
        "none",
        "With --online: keep hidden states for later epochs in RAM (exact) or on disk in "
        "bfloat16 under SAVE/online-cache (a cached sample trains on its bfloat16 states in "
        "every epoch); none recomputes them each epoch.",
        choices=CACHE_KINDS,
    )
    online_cache_gib: float = setting(
        4.0, "Size cap of --online-cache in GiB: the first samples that fit are cached."
    )
    # generate-data's reply settings as --prompts uses them; its batch and top-p stay as they are
    replies: ReplyConfig = section(
        ReplyConfig, keys={"backend": "generation_backend"}, hidden=("top_p", "batch_size"),
        help_prefix="With --prompts: ",
    )

    def __post_init__(self) -> None:
        check_choices(self)
        if self.prompts is not None:
            if not self.online:
                raise UserError(
                    "--prompts needs --online (offline training reads --data-path, made by "
                    "generate-data)."
                )
            if not prompt_source_exists(self.prompts):
                raise UserError(f"--prompts {self.prompts} does not exist.")
        for key, needs in self._unused():
            flag = key.replace("_", "-")
            raise UserError(f"--{flag} is used only with --{needs}; drop it or add --{needs}.")
        size = self.online_cache_gib
        if not (isinstance(size, int | float) and math.isfinite(size) and size > 0):
            fail("online_cache_gib", size, "a finite number > 0")

    def _unused(self):
        """``(key, flag it needs)`` of each setting changed from its default that does
        nothing without ``--online`` (the cache, the target's dtype) or ``--prompts``."""
        own = {f.name: f for f in fields(self)}
        if not self.online:
            for name in ("target_dtype", "online_cache", "online_cache_gib"):
                if getattr(self, name) != own[name].default:
                    yield name, "online"
        if self.prompts is None:
            keys = own["replies"].metadata["keys"]
            for f in fields(self.replies):
                if getattr(self.replies, f.name) != f.default:
                    yield keys.get(f.name, f.name), "prompts"


def online_data_path(config: TrainConfig) -> Path:
    """``--data-path``, or where ``--prompts`` keeps its replies."""
    if config.online.prompts:
        return Path(config.trainer.save_path) / REPLIES_DIR
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
        Path(config.trainer.save_path) / CACHE_DIR, key,
    )
    states = OnlineHiddenStates(model, layer_ids, cache)
    return open_training_data(
        data_path, draft_vocab_size=config.draft.draft_vocab_size, online=states
    )


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
        )
    world.barrier()
