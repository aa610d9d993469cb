"""The P-EAGLE algorithm's knobs: one typed, validated place for each default.

The sampler's signature, the trainer, the CLI and the saved checkpoint all read
their defaults from :class:`CODConfig`; nothing else repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name} must be {allowed}, got {value!r}.")


def check_int_at_least(name: str, value: object, low: int) -> int:
    """Return ``value`` if it is an int >= ``low``; else raise a one-sentence ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(name, value, f"an integer >= {low}")
    return value


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

    num_depths: int = 8
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    max_anchors: int | None = None

    def __post_init__(self) -> None:
        check_int_at_least("num_depths", self.num_depths, 1)
        r = self.down_sample_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0.0 < r <= 1.0:
            _fail("down_sample_ratio", r, "a number in (0, 1]")
        r_min = self.down_sample_ratio_min
        if isinstance(r_min, bool) or not isinstance(r_min, int | float) or not 0.0 <= r_min <= 1.0:
            _fail("down_sample_ratio_min", r_min, "a number in [0, 1]")
        if self.max_anchors is not None:
            check_int_at_least("max_anchors", self.max_anchors, 1)

    def depth_sample_size(self, n_valid: int, depth: int) -> int:
        """Elements drawn at ``depth >= 1``: ``int((n_valid - d) * max(r**d, r_min))``."""
        ratio = max(self.down_sample_ratio**depth, self.down_sample_ratio_min)
        return int(max(0, n_valid - depth) * ratio)
