"""A run's training data: opened, its layer ids settled, split, checked and its draft
vocabulary mapped (the second step of :func:`~.loop.build_training`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..common.errors import UserError
from ..data import default_target_layer_ids, open_training_data, split_samples
from .distributed import World
from .online_data import online_layer_ids, open_online_data
from .pretrained import check_pretrained_fits
from .served import kept_samples, open_served_data
from .train_config import TrainConfig
from .weights_start import WeightsStart

logger = logging.getLogger(__name__)

__all__ = ["RunData", "open_run_data"]


@dataclass
class RunData:
    """The data a run trains on, and what the draft is built from it."""

    data: object
    layer_ids: tuple[int, ...]  # the target's aux layers
    train_samples: object  # the samples of ``data`` trained on
    heldout_samples: tuple[int, ...]  # of data_path, scored after each checkpoint
    d2t: torch.Tensor
    t2d: torch.Tensor


def open_run_data(config: TrainConfig, start: WeightsStart, world: World) -> RunData:
    """Open the data, check the pretrained draft fits its layer ids, split off the held-out
    samples, then scan every hidden-state file and map the draft vocabulary."""
    verifier_config = start.verifier_config
    data, layer_ids = _open_data(config, verifier_config, world)
    if start.pretrained is not None:
        check_pretrained_fits(
            start.pretrained, config.draft.from_pretrained, num_layers=config.draft.num_layers,
            draft_vocab_size=config.draft.draft_vocab_size, target_layer_ids=layer_ids,
            target_hidden_size=verifier_config.hidden_size,
            norm_before_residual=config.draft.norm_before_residual,
        )
    train_samples, heldout_samples = split_samples(data, config.data.train_data_ratio, config.seed)
    train_samples = kept_samples(data, train_samples)
    data.validate(progress=world.rank == 0)
    d2t, t2d = data.vocab_mapping(
        config.draft.draft_vocab_size, target_vocab_size=verifier_config.vocab_size
    )
    return RunData(data, layer_ids, train_samples, heldout_samples, d2t, t2d)


def _open_data(config: TrainConfig, verifier_config, world: World):
    """``(data, aux layer ids)``: the target's states computed in training (``--online``),
    rows without states from vLLM servers (:mod:`.served`), or the files of ``data_path``."""
    if config.online.online:
        layer_ids = online_layer_ids(config, verifier_config)
        return open_online_data(config, layer_ids, world), layer_ids
    served = open_served_data(config, verifier_config, world)
    if served is not None:
        return served
    data = open_training_data(
        config.data.data_path, draft_vocab_size=config.draft.draft_vocab_size,
        verifier_hidden_size=verifier_config.hidden_size,
        aux_layer_ids=config.draft.target_layer_ids,
    )
    return data, _target_layer_ids(config, data, verifier_config)


def _target_layer_ids(config: TrainConfig, data, verifier_config) -> tuple[int, ...]:
    """The flag's (which ``open_training_data`` checked against the data), else the data's,
    else the default.

    Data made by ``generate-data`` records its layer ids; other data (speculators' own)
    records only their count, which is all that is checked.
    """
    layer_ids = data.target_layer_ids or default_target_layer_ids(verifier_config.num_hidden_layers)
    if data.settings is not None:
        return layer_ids
    if len(layer_ids) != data.num_aux_layers:
        raise UserError(
            f"--target-layer-ids {list(layer_ids)} names {len(layer_ids)} layers but "
            f"{config.data.data_path} holds {data.num_aux_layers} aux hidden states per token."
        )
    logger.info(
        "%s does not record which target layers its aux hidden states come from; "
        "training as layers %s (only their count, %d, could be checked)",
        config.data.data_path, list(layer_ids), data.num_aux_layers,
    )
    return layer_ids
