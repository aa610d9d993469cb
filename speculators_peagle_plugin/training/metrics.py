"""What one trainer forward reports: its loss share and per-depth accuracy counts.

Shapes (see :mod:`speculators_peagle_plugin.core`): ``K`` depths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pooled_accuracy(correct: torch.Tensor, valid: torch.Tensor) -> float:
    """Argmax matches over charged elements, all depths pooled (``correct, valid: [K]``)."""
    return float(correct.sum() / valid.sum().clamp(min=1))


def depth_accuracy(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[K]`` argmax accuracy per depth; a depth with no charged element reads 0."""
    return correct / valid.clamp(min=1)


def acceptance_length(acc: torch.Tensor) -> float:
    """Estimated tokens per verify step from ``[K]`` accuracies: ``1 + sum_k prod_{j<=k} acc_j``.

    Greedy chain acceptance, treating per-depth teacher-forced accuracies as
    independent acceptance rates; 1 is the bonus token.
    """
    return float(1 + torch.cumprod(acc.double(), 0).sum())


@dataclass
class PEagleStepMetrics:
    """Loss and accuracies of one forward (a batch, or one segment of it).

    Args:
        loss: grad-carrying scalar, this forward's share of the count-normalised batch loss.
        loss_sum: detached ``sum KL`` over the charged elements.
        correct: ``[K]`` argmax matches per depth.
        valid: ``[K]`` charged (supervised) elements per depth.
        total_den: the batch's one loss denominator (supervised elements in all rows).
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    total_den: torch.Tensor

    def __add__(self, other: PEagleStepMetrics) -> PEagleStepMetrics:
        return PEagleStepMetrics(
            self.loss + other.loss,
            self.loss_sum + other.loss_sum,
            self.correct + other.correct,
            self.valid + other.valid,
            self.total_den,
        )

    @property
    def accuracy(self) -> float:
        return pooled_accuracy(self.correct, self.valid)

    @property
    def accuracy_per_depth(self) -> list[float]:
        return depth_accuracy(self.correct, self.valid).tolist()

    @property
    def acceptance_length(self) -> float:
        """See :func:`acceptance_length`."""
        return acceptance_length(depth_accuracy(self.correct, self.valid))
