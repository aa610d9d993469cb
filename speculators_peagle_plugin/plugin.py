"""The algorithm object that the ``speculators.algorithms`` entry point names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import CODConfig
from .masks import create_peagle_mask_mod
from .sampling import assign_cod_segments, generate_cod_sample_indices


@dataclass(frozen=True)
class Algorithm:
    """What a training CLI needs to know about one drafting algorithm.

    Args:
        name: the value of ``--algorithm`` that selects it.
        summary: one line for listings.
        config_class: the typed knobs (defaults live there).
        sampler: draws the flattened training elements of one row.
        mask_mod_factory: builds the attention ``mask_mod`` over those elements.
        segment_assigner: splits the elements into sequence partitions.
    """

    name: str
    summary: str
    config_class: type
    sampler: Callable
    mask_mod_factory: Callable
    segment_assigner: Callable


PEAGLE = Algorithm(
    name="peagle",
    summary="P-EAGLE: parallel drafting of K tokens in one forward, COD sampling, "
    "exact sequence partitioning.",
    config_class=CODConfig,
    sampler=generate_cod_sample_indices,
    mask_mod_factory=create_peagle_mask_mod,
    segment_assigner=assign_cod_segments,
)
