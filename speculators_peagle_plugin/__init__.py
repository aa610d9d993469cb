"""speculators-peagle-plugin: train P-EAGLE parallel-drafting drafts and prove them in vLLM.

Importing the package only binds names; registration with speculators happens
through the ``speculators.algorithms`` entry point. Every name of the seed contract, the
private ones included, imports from :mod:`.seed_api`.
"""

from .core.peagle_attention import (
    create_peagle_mask_mod,
    dense_peagle_mask,
    document_ids_from_lengths,
    lengths_from_document_ids,
)
from .core.peagle_config import CODConfig
from .core.peagle_data import assign_cod_segments, generate_cod_sample_indices

__all__ = [
    "CODConfig",
    "assign_cod_segments",
    "create_peagle_mask_mod",
    "dense_peagle_mask",
    "document_ids_from_lengths",
    "generate_cod_sample_indices",
    "lengths_from_document_ids",
]
