"""Online training's settings (the ``online`` section) and its states cache: token ids
(given, or the target's replies generated first) whose hidden states the target computes as
each batch is read (:mod:`..datagen.online_states`); a run's online data is opened by
:mod:`.online_data`.

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

from ..common.dtypes import DTYPE_NAMES
from ..common.errors import UserError
from ..common.settings import check_choices, fail, section, setting
from ..data import TrainingData
from ..data.prompts import prompt_source_exists
from ..datagen.datagen_config import ReplyConfig
from ..datagen.online_states import CACHE_KINDS
from .distributed import World

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
        prompts=True,
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
