"""Algorithm discovery through the ``speculators.algorithms`` entry-point group.

Any installed distribution that declares the group offers an algorithm; ``--algorithm NAME``
picks one. The training loop reaches an algorithm only through :class:`Algorithm`'s two
builders and the :class:`TrainerModule` protocol of what ``build_trainer`` returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from ..common.errors import UserError

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "speculators.algorithms"


class TrainerModule(Protocol):
    """What the training loop calls on the module an algorithm's ``build_trainer`` returns.

    ``generator`` is set by the loop before each step: the step's random draws (COD
    sampling, for P-EAGLE) come from it, so a step is a pure function of its seed.
    ``num_depths`` is ``K``, the length of the per-depth counts. ``segments(batch)`` lists
    the step's forwards, each back-propagated on its own (``[None]``: one forward over the
    batch). ``forward_batch(batch, segment)`` returns metrics with ``loss``
    (grad-carrying), ``loss_sum``, ``total_den``, and ``[K]`` ``correct`` / ``valid``
    counts.
    """

    generator: torch.Generator | None
    num_depths: int

    def segments(self, batch: dict) -> list: ...

    def forward_batch(self, batch: dict, peagle_segment: Any = None) -> Any: ...


@dataclass(frozen=True)
class Algorithm:
    """A drafting algorithm, as its entry point offers it.

    Args:
        name: the value of ``--algorithm`` that selects it.
        summary: one line for listings.
        build_draft: ``(train_config, *, d2t, t2d, target_layer_ids, mask_token_id) ->
            draft`` (a speculators ``SpeculatorModel``).
        build_trainer: ``(draft, train_config, *, mask_token_id) ->`` a
            :class:`TrainerModule` over the draft.
    """

    name: str
    summary: str
    build_draft: Callable
    build_trainer: Callable


def discover_algorithms() -> dict[str, object]:
    """``{name: algorithm}`` for every ``speculators.algorithms`` entry point installed."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_algorithm(name: str):
    """Load the algorithm ``name``; an unknown name raises ``ValueError`` listing the known."""
    found = discover_algorithms()
    if name not in found:
        raise UserError(
            f"Unknown algorithm {name!r}; installed: {', '.join(sorted(found)) or 'none'}."
        )
    return found[name].load()
