"""Algorithm discovery through the ``speculators.algorithms`` entry-point group.

Any installed distribution that declares the group offers an algorithm; ``--algorithm NAME``
picks one. An algorithm object provides what the training loop calls: ``build_draft`` and
``build_trainer`` (see :class:`Algorithm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "speculators.algorithms"


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
        build_draft: ``(train_config, *, d2t, t2d, target_layer_ids, mask_token_id) ->
            draft`` (a speculators ``SpeculatorModel``).
        build_trainer: ``(draft, train_config, *, mask_token_id) -> module`` with
            ``forward_batch(batch, peagle_segment=None)`` returning metrics with ``.loss``
            and ``build_peagle_plan(loss_mask, document_ids=...)``.
    """

    name: str
    summary: str
    config_class: type
    sampler: Callable
    mask_mod_factory: Callable
    segment_assigner: Callable
    build_draft: Callable | None = None
    build_trainer: Callable | None = None


def discover_algorithms() -> dict[str, object]:
    """``{name: algorithm}`` for every ``speculators.algorithms`` entry point installed."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_algorithm(name: str):
    """Load the algorithm ``name``; an unknown name raises ``ValueError`` listing the known."""
    found = discover_algorithms()
    if name not in found:
        raise ValueError(
            f"Unknown algorithm {name!r}; installed: {', '.join(sorted(found)) or 'none'}."
        )
    return found[name].load()
