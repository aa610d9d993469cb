"""The P-EAGLE algorithm as the ``speculators.algorithms`` entry point ``peagle`` names it.

Importing this module binds names only; ``build_draft`` registers the draft class with
speculators' model registry when a draft is first built.
"""

from __future__ import annotations

import torch

from .model.build import build_peagle_draft
from .training.algorithm import Algorithm
from .training.peagle_trainer import PEagleTrainerModule


def build_peagle_trainer(draft, config, *, mask_token_id):
    """:class:`PEagleTrainerModule` over ``draft`` with the config's ``peagle`` and ``loss``
    sections."""
    vocab = draft.embed_tokens.num_embeddings
    if draft.d2t is not None:  # d2t holds offsets: target id = draft id + d2t[draft id]
        selected = draft.d2t + torch.arange(len(draft.d2t), device=draft.d2t.device)
        selected_mask = draft.t2d
    else:
        selected = torch.arange(vocab)
        selected_mask = torch.ones(vocab, dtype=torch.bool)
    return PEagleTrainerModule.from_config(draft, selected, selected_mask, mask_token_id, config)


PEAGLE = Algorithm(
    name="peagle",
    summary="P-EAGLE: parallel drafting of K tokens in one forward, COD sampling, "
    "exact sequence partitioning.",
    build_draft=build_peagle_draft,
    build_trainer=build_peagle_trainer,
)
