"""The P-EAGLE algorithm's knobs (the ``peagle`` section): one typed, validated place each.

The sampler's signature, the trainer, the CLI and the saved checkpoint all read their
defaults from :class:`CODConfig` / :class:`PEagleConfig`; nothing else repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common.settings import check_int_at_least, fail, section, setting


@dataclass(frozen=True)
class CODConfig:
    """Conditional-On-Distribution (COD) sampling knobs of P-EAGLE.

    Args:
        num_depths: parallel prediction depths ``K`` (>= 1); depth 0 is the real context.
        down_sample_ratio: geometric decay ``r`` in (0, 1]; depth ``d`` keeps about
            ``r**d`` of the supervised positions.
        down_sample_ratio_min: floor ``r_min`` in [0, 1] on that fraction.
        max_anchors: optional cap on how many chains may start (speculators' knob).
    """

    num_depths: int = setting(8, "Parallel depths trained (COD depths).", card=True)
    down_sample_ratio: float = setting(0.7, "COD decay ratio r.", card=True)
    down_sample_ratio_min: float = setting(0.2, "COD floor r_min.", card=True)
    max_anchors: int | None = setting(None, "Cap on COD chain starts per row.")

    def __post_init__(self) -> None:
        check_int_at_least("num_depths", self.num_depths, 1)
        r = self.down_sample_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 < r <= 1.0:
            fail("down_sample_ratio", r, "a number in (0, 1]")
        r_min = self.down_sample_ratio_min
        if isinstance(r_min, bool) or not isinstance(r_min, int | float) or not 0.0 <= r_min <= 1.0:
            fail("down_sample_ratio_min", r_min, "a number in [0, 1]")
        if self.max_anchors is not None:
            check_int_at_least("max_anchors", self.max_anchors, 1)

    def depth_sample_size(self, n_valid: int, depth: int) -> int:
        """Elements drawn at ``depth >= 1``: ``int((n_valid - d) * max(r**d, r_min))``."""
        ratio = max(self.down_sample_ratio**depth, self.down_sample_ratio_min)
        return int(max(0, n_valid - depth) * ratio)


@dataclass(frozen=True)
class PEagleConfig:
    """The ``peagle`` section: COD sampling (its ``cod`` part, whose keys are the section's
    own: ``num_depths``, not ``cod.num_depths``) plus how rollouts are drawn and rows split.

    Args:
        cod: the sampler's knobs (:class:`CODConfig`).
        sequence_partitions: segments ``S`` per row (Algorithm 1); exact for any ``S``.
        greedy_chains: draw the rollouts of depths >= 1 only along the target's greedy path.
    """

    cod: CODConfig = section(CODConfig)

    sequence_partitions: int = setting(
        1, "Segments per row (P-EAGLE Algorithm 1); exact.", card=True
    )
    greedy_chains: bool = setting(
        False,
        "Draw the COD rollouts that train depths >= 1 only along the target's greedy path "
        "(every reply token between anchor and position is the target's argmax): greedy "
        "serving verifies no other, and sampled replies leave it often.",
    )

    def __post_init__(self) -> None:
        check_int_at_least("sequence_partitions", self.sequence_partitions, 1)
